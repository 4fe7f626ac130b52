"""The GPU check: every chapter in the trimmed gpu profile on a CUDA machine without network.

    python -m bookbuild.gpu_check install [--wheels .whl] [--target /tmp/precision-lab-site]
    python -m bookbuild.gpu_check expect   # per chapter: computed memory estimate, L4/A100 fit, GPU seconds if run
    PYTHONPATH=/tmp/precision-lab-site:. python -m bookbuild.gpu_check run [STEM ...] [--budget 330]
    make gpu-check        # both, with that machine's own Python and torch

`install` needs only the standard library: it runs before the book's libraries exist. It installs
from the wheel folder (`make wheels`) what the machine lacks, plus the libraries whose versions
the chapters are about, and checks that the rest imports, before any chapter runs. `run` executes
each chapter with papermill, writes `results/gpu/<chapter>.json` with provenance for each chapter
that completed, prints its seconds, and estimates what the untrimmed gpu profile would take.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "gpu"
TARGET = "/tmp/precision-lab-site"
NEEDED = ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "papermill", "jupytext",
          "ipykernel", "myst_nb.ext.glue", "pandas", "scipy", "matplotlib", "datasets")


def install(wheels: Path, target: str) -> None:
    """Install the wheels this Python lacks (and MATCH's always) into `target`; refuse early if one still fails."""
    from .wheels import MATCH, canonical

    if not wheels.is_dir() or not any(wheels.glob("*.whl")):
        raise SystemExit(f"no wheels in {wheels}: run `make wheels PYVER=3.12` where there is network, "
                         "and bring the folder along.")

    def missing(wheel: Path) -> bool:
        name = canonical(wheel.name.split("-")[0])
        try:
            metadata.version(name)
            return name in MATCH
        except metadata.PackageNotFoundError:
            return True

    chosen = [str(w) for w in sorted(wheels.glob("*.whl")) if missing(w)]
    if chosen:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", target, *chosen], check=True)
    probe = ("import importlib, torch\nmissing = []\n"
             f"for name in {NEEDED!r}:\n"
             "    try:\n        importlib.import_module(name)\n"
             "    except Exception as err:\n        missing.append(f'{name} ({type(err).__name__}: {err})')\n"
             "if not torch.cuda.is_available():\n    missing.append('a CUDA device (torch sees none)')\n"
             "print('; '.join(missing))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([target, str(ROOT), os.environ.get("PYTHONPATH", "")])}
    check = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    missing = check.stdout.strip() or check.stderr.strip()
    if missing:
        raise SystemExit(f"after installing {len(chosen)} wheels the book still cannot start here; missing: {missing}")
    print(f"installed {len(chosen)} wheels into {target}; every library the chapters import is there")


def _scale(stem: str, full, trimmed) -> float:
    """How much more work the untrimmed gpu profile does than the trimmed one, by the chapter's dominant loop."""
    loops = {
        "00_lab": (full.warmup.steps + full.moe_warmup.steps) / (trimmed.warmup.steps + trimmed.moe_warmup.steps),
        "02_qlora_crash": full.grpo.steps / trimmed.grpo.steps,
        "04_mismatch": full.mismatch.sequences / trimmed.mismatch.sequences,
        "05_grpo_precision": full.rl.steps / trimmed.rl.steps,
        "05b_sampler_precision": (full.sampler_rl.steps * full.sampler.seeds)
        / (trimmed.sampler_rl.steps * trimmed.sampler.seeds),
        "06_moe": full.rl.steps / trimmed.rl.steps,
        "07_lora": full.grpo.steps / trimmed.grpo.steps,
        "10_scaling_out": full.rl.steps / trimmed.rl.steps,
    }
    return loops.get(stem, 1.0)


L4_GIB, A100_GIB = 24, 40  # the smaller cards readers rent: Colab's L4, a 40 GB A100


def memory_estimate(profile) -> dict[str, float]:
    """A rough peak of each chapter's GPU memory in GiB, computed from the profile (not measured).

    Weights, gradients and AdamW state in fp32 (16 bytes a parameter); the activations kept for a
    backward through the largest training batch (34 bytes per token, hidden unit and layer in 16-bit,
    Korthikanti et al. 2022, doubled for fp32, attention by SDPA); the sampler's fp32 KV cache at its
    largest (every sequence sampled at once, lengths uniform up to the longest, finished ones leaving
    the batch: half the sequences at half the length) with its per-token log-probabilities over the
    vocabulary; and fp32 logits. `make gpu-check` records the measured peaks where chapters do.
    """
    from labutils import task

    vocab = 32  # the lab's character vocabulary, rounded up

    def params(size):
        mlp = 3 * size.hidden_size * size.intermediate_size * max(1, size.num_experts)
        kv = 2 * size.hidden_size * size.hidden_size * size.num_kv_heads // size.num_heads
        return size.num_layers * (2 * size.hidden_size ** 2 + kv + mlp) + vocab * size.hidden_size

    def training(size, tokens):
        return 16 * params(size) + 68 * tokens * size.hidden_size * size.num_layers + 12 * tokens * vocab

    def sampling(size, sequences, longest):
        kv_per_token = 2 * size.num_layers * size.hidden_size * size.num_kv_heads // size.num_heads * 4
        return 4 * params(size) + sequences * longest * (kv_per_token / 4 + 4 * vocab)

    def scoring(size, tokens):
        return 4 * params(size) + 4 * 12 * tokens * size.hidden_size + 4 * tokens * vocab

    def rl_tokens(plan):
        return plan.batch_size * (8 + task.completion_length(plan.max_walk) + 1)

    dense, moe, m, d = profile.dense, profile.moe, profile.mismatch, profile.sampler
    batch = m.micro_batch * (8 + m.max_len)
    need = {
        "00_lab": training(dense, profile.warmup.batch_size * (8 + task.completion_length(profile.warmup.max_walk))),
        "02_qlora_crash": training(dense, rl_tokens(profile.grpo)),
        "03_loss_scaling": training(dense, rl_tokens(profile.grpo)),
        "04_mismatch": max(sampling(dense, m.sequences, m.max_len), scoring(dense, batch)),
        "05_grpo_precision": training(dense, rl_tokens(profile.rl)),
        "05b_sampler_precision": max(training(dense, rl_tokens(profile.sampler_rl)),
                                     sampling(dense, d.dial_sequences, 2 * d.dial_length)),
        "06_moe": max(training(moe, rl_tokens(profile.rl)), sampling(moe, m.sequences, m.max_len), scoring(moe, batch)),
        "07_lora": training(dense, rl_tokens(profile.grpo)),
        "08_sensitive_ops": scoring(dense, batch),
        "09_fp8": 36 * 4096 ** 2,  # the n x 2n and 2n x n operands in fp32, bf16 and FP8, and the outputs, n = 4096
        "10_scaling_out": training(dense, rl_tokens(profile.rl)),
    }
    return {stem: round(need.get(stem, 0) / 2**30, 2) for stem in need}


def provenance(trimmed) -> dict:
    """Which GPU, driver, CUDA and libraries, and the trimmed parameters, for every results file of this run."""
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = "unknown"
    commit = os.environ.get("BOOK_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:  # no git on the GPU machine: BOOK_COMMIT names the commit
            commit = ""
    versions = {}
    for name in NEEDED:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = "?"
    return {"gpu": torch.cuda.get_device_name(0), "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1), "driver": driver, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "versions": versions, "commit": commit or "unknown",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "chapters_at_once": 1,
            "trimmed": True, "parameters": dataclasses.asdict(trimmed)}


def _execute(stem: str, work: Path, timeout: float) -> tuple[float, str]:
    """Run one chapter with papermill in its own process; (seconds, "" or what went wrong)."""
    import jupytext

    from . import pipeline

    plain, executed = work / f"{stem}.ipynb", work / f"{stem}.out.ipynb"
    notebook = jupytext.read(ROOT / "chapters" / f"{stem}.md")
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    jupytext.write(notebook, plain)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "papermill", "--no-progress-bar", str(plain), str(executed),
                               "-p", "profile", "gpu", "--cwd", str(ROOT)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, f"stopped after {timeout:.0f} s"
    seconds = time.perf_counter() - start
    if not executed.is_file():  # papermill stopped before the notebook ran: no kernel, an import error, memory
        last = [line for line in done.stderr.splitlines() if line.strip()]
        return seconds, last[-1] if last else f"papermill exited with {done.returncode} and wrote no notebook"
    try:
        if done.returncode:
            pipeline._accept_expected_errors(executed)
        pipeline._check_required_errors(executed, "cuda")
    except pipeline.ChapterError as err:
        return seconds, (str(err) or type(err).__name__).splitlines()[0]
    return seconds, ""


def engines_agree(device: str) -> float:
    """Sample with the KV-cached inference engine and rescore with the training engine, both fp32, on a tiny
    random model; returns the largest log-probability gap. Any transformers whose cache the engine does not
    use gives gaps of order 0.1, or no finite probabilities at all (an infinite gap): every mismatch a chapter
    measured would be that bug."""
    import torch
    from transformers import AutoModelForCausalLM

    from labutils import models, profiles, rollout

    torch.manual_seed(0)
    tokenizer = models.build_tokenizer()
    size = profiles.ModelSize(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    model = AutoModelForCausalLM.from_config(models.build_config(size, tokenizer))
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("3+7*4=", "12+5*9=", "1+1*1=")]
    try:
        out = rollout.InferenceEngine(model, torch.float32, device).sample(
            prompts, max_new_tokens=24, min_new_tokens=24, generator=torch.Generator(device).manual_seed(0))
    except RuntimeError as err:  # without its cache a left-padded row's step sees no key: NaN probabilities
        if "not finite" in str(err):
            return float("inf")
        raise
    scored = rollout.TrainingEngine(model, torch.float32, device).score(out)
    return float((scored.logprobs - out.logprobs)[out.mask].abs().max())


def run(stems: list[str], budget: float, out: Path = OUT) -> dict:
    """Execute `stems` (all chapters by default) within `budget` seconds; returns {stem: outcome}."""
    import torch

    from labutils import profiles
    from . import pipeline

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check run needs a CUDA GPU, and torch sees none here.")
    gap = engines_agree("cuda")
    if gap > 1e-3:
        raise SystemExit(f"sampling and rescoring the same fp32 weights disagree by {gap:.2g} nats with this "
                         f"transformers; its KV cache is not being used as the engines expect.")
    os.environ[profiles.GPU_TRIMMED] = "1"
    full, trimmed = profiles.PROFILES["gpu"], profiles.gpu_trimmed(profiles.PROFILES["gpu"])
    record = provenance(trimmed)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    os.environ["LAB_RESULTS_DIR"] = str(work / "results")
    out.mkdir(parents=True, exist_ok=True)
    began, outcomes = time.perf_counter(), {}
    print(f"{record['gpu']} (capability {record['capability']}, driver {record['driver']}, CUDA {record['cuda']})")
    print(f"{'chapter':<24}{'seconds':>9}{'untrimmed est.':>16}  outcome")
    for stem in stems or pipeline.chapters():
        left = budget - (time.perf_counter() - began)
        if left < 10:
            outcomes[stem] = "not run: the budget was spent"
            print(f"{stem:<24}{'-':>9}{'-':>16}  {outcomes[stem]}")
            continue
        seconds, problem = _execute(stem, work, timeout=left)
        produced = work / "results" / f"{stem}.json"
        if not problem and produced.is_file():
            data = json.loads(produced.read_text())
            data["provenance"] = {**record, "seconds": round(seconds, 1),
                                  "untrimmed_estimate_s": round(seconds * _scale(stem, full, trimmed))}
            (out / f"{stem}.json").write_text(json.dumps(data, indent=1, sort_keys=True))
        outcomes[stem] = problem or ("completed" if produced.is_file() else "no results file written")
        estimate = f"{seconds * _scale(stem, full, trimmed):.0f}" if not problem else "-"
        print(f"{stem:<24}{seconds:>9.1f}{estimate:>16}  {outcomes[stem]}", flush=True)
    print(f"total {time.perf_counter() - began:.0f} s; results of completed chapters in {out}")
    shutil.rmtree(work, ignore_errors=True)
    return outcomes


def expectations(root: Path = ROOT) -> list[dict]:
    """Per chapter: the computed memory estimate against an L4 and a 40 GB A100, and the H200 run's seconds if any."""
    from labutils import profiles
    from . import pipeline

    memory = memory_estimate(profiles.PROFILES["gpu"])
    rows = []
    for stem in pipeline.chapters(root):
        run = json.loads(path.read_text()).get("provenance", {}) if (path := root / "results" / "gpu" /
                                                                    f"{stem}.json").is_file() else {}
        gib = memory.get(stem, 0.0)
        rows.append({"chapter": stem, "peak memory estimate (GiB, computed)": gib,
                     "fits an L4": gib < L4_GIB, "fits an A100 40GB": gib < A100_GIB,
                     "trimmed run (s)": run.get("seconds"), "on": run.get("gpu"),
                     "untrimmed estimate (s)": run.get("untrimmed_estimate_s")})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("command", choices=("install", "run", "expect"))
    parser.add_argument("stems", nargs="*", help="chapters to run (default: all)")
    parser.add_argument("--wheels", default=str(ROOT / ".whl"), type=Path)
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--budget", default=330.0, type=float, help="seconds for all chapters together")
    args = parser.parse_args(argv)
    if args.command == "install":
        install(args.wheels, args.target)
    elif args.command == "expect":
        for row in expectations():
            print("  ".join(f"{k}: {v}" for k, v in row.items()))
    else:
        run(args.stems, args.budget)


if __name__ == "__main__":
    main()
