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
import tempfile
import time
from pathlib import Path

from .workshop_speed import expected_minutes, load_reference, machine, ratios, workload

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
