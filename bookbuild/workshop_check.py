"""Before a workshop: the models its exercises need, built once, and a short check a participant can run.

    python -m bookbuild.workshop_check prepare   # the lab's models for the seeds the exercises use
    python -m bookbuild.workshop_check check     # about two minutes: libraries, a kernel, 4-bit, one GRPO step,
                                                 # JupyterLab opening a chapter's source as a notebook, and
                                                 # the expected minutes of each workshop exercise here

The expected minutes come from a short workload (one forward of a toy-sized and of a SmolLM2-wide model,
in fp32, bf16 and fp16) timed here and compared with the same workload timed by the build that measured
the chapters (`_build/workshop/reference.json`, also served beside the workshop page; `--reference FILE`).
Both use the cpu profile unless told otherwise; `make workshop-prep` runs both.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

SEEDS = (0,)  # the book's seed: every exercise of the workshop plan runs on it


def prepare(profile_name: str = "cpu") -> list[str]:
    """Build (or find) the dense and MoE lab models for every seed the exercises use; returns their folders."""
    from labutils import models, profiles

    profile = profiles.resolve(profile_name)
    built = []
    for seed in SEEDS:
        for kind in models.KINDS:
            start = time.perf_counter()
            path = models.lab_model_dir(kind, profile, seed)
            built.append(models.display_path(path))
            print(f"{kind} model, seed {seed}: {built[-1]} ({time.perf_counter() - start:.0f} s)")
    return built


def interactive(chapter: str = "01_number_formats", timeout: float = 90.0) -> str:
    """Start `jupyter lab` on the book and ask it for a chapter's Markdown source as a notebook, as a participant's
    browser would (jupytext's contents manager pairs the two); returns what it served."""
    import importlib.util
    import json
    import secrets
    import socket
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    from .layout import ROOT

    if importlib.util.find_spec("jupyterlab") is None or importlib.util.find_spec("jupytext") is None:
        raise RuntimeError("JupyterLab or jupytext is not installed: pip install -e '.[workshop]' (make workshop-prep "
                           "does it), then run this check again.")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = secrets.token_hex(16)
    server = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
                               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}",
                               "--allow-root"],  # harmless for a participant; a container often runs as root
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/api/contents/chapters/{chapter}.md?type=notebook&content=1"
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    model = json.load(answer)
                break
            except OSError as error:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter lab did not serve {chapter}.md as a notebook ({error}): "
                                       f"{(server.stderr.read() if server.poll() is not None else '')[-500:]}")
                time.sleep(1)
    finally:
        server.terminate()
        server.wait(timeout=30)
    cells = model["content"]["cells"] if model.get("type") == "notebook" else []
    if not cells:
        raise RuntimeError(f"jupyter lab served {chapter}.md as a {model.get('type')}, not as a notebook: is "
                           "jupytext's server extension enabled (`jupyter server extension list`)?")
    return f"{Path(chapter).name}.md opens as a notebook of {len(cells)} cells"


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


def speed(reference_path: Path | None = None) -> str:
    """Time the workload here and print each workshop exercise's expected minutes on this machine."""
    from . import workshop
    from .layout import ROOT

    here = workload()
    reference = load_reference(reference_path)
    mine = machine()
    print(f"    this machine: {mine['cpu']} ({mine['system']}; {mine['kernels']}; {here['threads']} torch threads)")
    for key, value in here["seconds"].items():
        print(f"    {key:<16}{value * 1000:8.1f} ms" + (f"  (build: {reference['seconds'][key] * 1000:.1f} ms)"
                                                         if reference and key in reference["seconds"] else ""))
    size = workshop.footprint()
    print(f"    this install: Python environment {size['environment_bytes'] / 1e9:.1f} GB, lab cache "
          f"{size['lab_cache_bytes'] / 1e6:.0f} MB")
    if reference is None:
        return ("no reference timing found: download reference.json from the workshop page and pass "
                "--reference FILE to see the exercises' minutes here")
    scale = ratios(here, reference)
    print(f"    the build's machine: {reference['cpu']} ({reference['system']}; {reference['kernels']}; "
          f"{reference['threads']} torch thread{'s' if reference['threads'] > 1 else ''}, timed {reference['timed']})")
    print(f"    {'exercise':<34}{'here':>12}{'run first':>14}  block")
    for line in expected_minutes(reference.get("exercises") or workshop.exercise_rows(ROOT), scale):
        print("    " + line)
    toy, real = scale["toy"], scale["real"]
    return (f"this machine takes {toy[0]:.2g}–{toy[1]:.2g}× the build's time on the toy and "
            f"{real[0]:.2g}–{real[1]:.2g}× on the real model's shapes")


def _step(name: str, fn):
    start = time.perf_counter()
    outcome = fn()
    print(f"ok  {name} ({time.perf_counter() - start:.1f} s){': ' + outcome if outcome else ''}")


def check(reference: Path | None = None) -> None:
    """Libraries, a notebook kernel, bitsandbytes' 4-bit layer, one GRPO step of trl on a tiny model, and the
    workshop exercises' expected minutes on this machine."""
    import torch

    from labutils import env_report, grpo, models, profiles, rollout
    from . import pipeline

    report = env_report()
    print(", ".join(f"{k} {v}" for k, v in report.items()))
    tiny = dataclasses.replace(
        profiles.PROFILES["cpu"], name="check",
        dense=profiles.ModelSize(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
                                 max_positions=256),
        warmup=profiles.WarmupPlan(steps=3, batch_size=4, lr=1e-3, min_walk=1, max_walk=3))
    with tempfile.TemporaryDirectory(prefix="workshop-check-") as scratch:
        import os

        os.environ["LAB_CACHE"] = scratch

        def four_bit():
            model, _ = grpo.load_4bit(tiny)
            ids = torch.tensor([[3, 4, 5]])
            model(input_ids=ids, labels=ids).loss.backward()
            return f"{sum(p.numel() for p in model.parameters())} parameters, NF4 forward and backward"

        def grpo_step():
            model, tokenizer = models.load(None, "dense", tiny)
            plan = dataclasses.replace(tiny.rl, steps=1, batch_size=4, num_generations=2, min_walk=1, max_walk=3,
                                       prompts=16)
            sampler = grpo.EngineRollout(rollout.InferenceEngine(model, torch.float32), max_new_tokens=24, seed=0)
            trainer = grpo.engine_trainer(model, tokenizer, grpo.config(tiny, scratch, plan=plan), tiny, sampler,
                                          torch.float32, plan=plan)
            trainer.train()
            return f"trl {report['trl']}, {trainer.state.global_step} step"

        def kernel():
            build = pipeline.own_build("workshop-check")
            pipeline.execute("01_number_formats", "cpu", force=True, build=build)
            return f"chapter 1 executed into {build.relative_to(pipeline.ROOT)}"

        _step("bitsandbytes 4-bit", four_bit)
        _step("one GRPO step", grpo_step)
        _step("papermill and a kernel", kernel)
        _step("jupyter lab and jupytext", interactive)
    _step("speed and the exercises' minutes here", lambda: speed(reference))
    print("ready for the workshop")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("command", choices=("prepare", "check"))
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--reference", type=Path, default=None,
                        help="the build's workload timing (reference.json from the workshop page)")
    args = parser.parse_args(argv)
    prepare(args.profile) if args.command == "prepare" else check(args.reference)


if __name__ == "__main__":
    main()
