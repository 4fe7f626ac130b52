"""The participants' speed check: a short workload (one forward of a toy-sized and of a SmolLM2-wide model, in
fp32, bf16 and fp16) timed here and by the build that measured the chapters, and each exercise's expected
minutes from their ratio."""
from __future__ import annotations

import json
import time
from pathlib import Path


DTYPES = ("float32", "bfloat16", "float16")
# The toy is the cpu profile's dense lab model; "real" is as wide as SmolLM2-135M-Instruct (hidden 576, MLP 1536,
# 9 query and 3 key-value heads, vocabulary 49,152) with 2 of its 30 layers: the chapters on the real model spend
# their time in matmuls of these shapes, those on the toy in many small ones.
SHAPES = {"toy": (8, 64), "real": (2, 32)}  # (sequences, tokens) of one forward
REFERENCE = Path("_build") / "workshop" / "reference.json"


def _workload_model(shape: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

    from labutils import models, profiles

    torch.manual_seed(0)
    if shape == "toy":
        return Qwen2ForCausalLM(models.build_config(profiles.PROFILES["cpu"].dense, models.build_tokenizer()))
    return LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                        num_key_value_heads=3, num_hidden_layers=2, vocab_size=49152,
                                        tie_word_embeddings=True))


def workload(threads: int | None = None, budget: float = 0.4) -> dict:
    """Seconds of one forward pass of each workload shape in each dtype (the fastest of passes run for about
    `budget` seconds after one warm-up pass), with `threads` torch threads (default: torch's own)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    seconds = {}
    try:
        for shape, (rows, tokens) in SHAPES.items():
            model = _workload_model(shape).eval()
            ids = torch.randint(3, model.config.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(0))
            for name in DTYPES:
                model.to(getattr(torch, name))
                passes = []
                with torch.inference_mode():
                    model(input_ids=ids)  # warm-up: kernels chosen, memory allocated
                    while len(passes) < 3 or (sum(passes) < budget and len(passes) < 50):
                        start = time.perf_counter()
                        model(input_ids=ids)
                        passes.append(time.perf_counter() - start)
                seconds[f"{shape}.{name}"] = min(passes)  # the least disturbed by other work on the machine
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    return {"seconds": seconds, "threads": used}


def machine() -> dict:
    """This machine in the words the check prints: CPU, torch's kernel set, operating system."""
    import platform

    from labutils import env

    return {"cpu": env.cpu_model(), "kernels": env.kernel_set(), "system": f"{platform.system()} {platform.machine()}"}


def record_reference(path: Path, threads: int = 1) -> dict:
    """Time the workload as the build's chapters ran (one torch thread each, two chapters at a time) and write
    it to `path` with the machine's description; returns what it wrote."""
    data = {**workload(threads=threads), **machine(), "timed": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def ratios(here: dict, reference: dict) -> dict[str, tuple[float, float]]:
    """Per workload shape, the smallest and largest ratio (this machine's seconds over the reference's) over the
    dtypes: a chapter's run here takes its build time times a ratio in that range, by the precisions it uses."""
    out = {}
    for shape in SHAPES:
        each = [here["seconds"][f"{shape}.{d}"] / reference["seconds"][f"{shape}.{d}"] for d in DTYPES
                if reference["seconds"].get(f"{shape}.{d}")]
        out[shape] = (min(each), max(each))
    return out


def expected_minutes(rows: list[dict], scale: dict[str, tuple[float, float]]) -> list[str]:
    """Lines of the check's table from the build's exercise rows (`workshop.exercise_rows`): each exercise's
    minutes here (its minutes in the plan, with its own run's build time scaled by its workload's range) and the
    minutes of the cells above it (scaled by the range over both workloads: chapters mix the toy and the real
    model)."""
    every = (min(low for low, _ in scale.values()), max(high for _, high in scale.values()))
    lines = []
    for row in rows:
        if row.get("own_seconds") is None:
            lines.append(f"{row['label']:<34}{'not in the build':>26}  {row['block']}")
            continue
        low, high = scale[row["workload"]]
        think = row["minutes"] - row["own_seconds"] / 60
        own = (think + row["own_seconds"] * low / 60, think + row["own_seconds"] * high / 60)
        first = (row["first_seconds"] * every[0] / 60, row["first_seconds"] * every[1] / 60)
        lines.append(f"{row['label']:<34}{_span(own):>12}{_span(first):>14}  {row['block']}")
    return lines


def _span(pair: tuple[float, float]) -> str:
    low, high = pair
    show = (lambda m: f"{m:.1f}") if high < 10 else (lambda m: f"{m:.0f}")
    return f"{show(low)} min" if show(low) == show(high) else f"{show(low)}–{show(high)} min"


def load_reference(path: Path | None = None) -> dict | None:
    """The build's workload timing: `path`, else the clone's `_build/workshop/reference.json`, else None."""
    from .layout import ROOT

    for candidate in (path, ROOT / REFERENCE):
        if candidate is not None and Path(candidate).is_file():
            return json.loads(Path(candidate).read_text())
    return None
