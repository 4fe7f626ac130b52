"""The workshop page: a half-day plan whose run times are read from this build's results."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from labutils.results import load_all

from . import status

@dataclass(frozen=True)
class Block:
    name: str
    minutes: int  # teaching and discussion
    chapters: tuple[str, ...] = ()
    objectives: str = ""
    prerequisites: str = ""
    exercises: tuple[tuple[str, int, int], ...] = ()  # (chapter, exercise number, minutes) the room does
    figure: tuple[str, str] | None = None  # (chapter, figure name): the one to put on the projector


PLAN = [
    Block("Formats and the lab", 30, ("00_lab", "01_number_formats"),
          "read bf16, fp16 and FP8 layouts off real casts; say what eps, the largest and the smallest normal "
          "number of each format are; meet the task and the tiny models",
          "binary floating point (sign, exponent, mantissa)", (("01_number_formats", 1, 10), ("00_lab", 2, 10)),
          ("01_number_formats", "spacing")),
    Block("The crash", 30, ("02_qlora_crash", "03_loss_scaling", "11_troubleshooting"),
          "reproduce the QLoRA GRPO error, trace it into trl, accelerate and torch, predict it with preflight, "
          "and choose a fix by memory, speed and reward",
          "autocast (what it casts, where), a GradScaler's scale, unscale and skip",
          (("02_qlora_crash", 1, 10), ("03_loss_scaling", 2, 10)), ("03_loss_scaling", "scale-trace")),
    Block("Break", 15),
    Block("The mismatch", 60, ("04_mismatch", "04b_real_mismatch", "05_grpo_precision", "05b_sampler_precision"),
          "measure KL(μ‖π) between an inference and a training engine, on the toy and on a real 135M model, see "
          "the sequence log-ratio drift with length, run GRPO under precision pairs, and turn the sampler's "
          "precision dial to see when RL degrades",
          "importance ratios π/μ and why off-policy samples need them; KL divergence and its k1/k3 estimators",
          (("04_mismatch", 2, 15), ("04b_real_mismatch", 1, 10), ("05b_sampler_precision", 1, 15)),
          ("04b_real_mismatch", "offline")),
    Block("MoE and LoRA", 40, ("06_moe", "07_lora"),
          "count routing flips and the KL they cause; count LoRA updates lost to bf16's spacing",
          "top-k routing; Adam's update size; LoRA's A and B", (("06_moe", 1, 10), ("07_lora", 2, 10)),
          ("06_moe", "flips-by-position")),
    Block("Toolkit", 30, ("08_sensitive_ops", "09_fp8", "10_scaling_out"),
          "say which operations need fp32, what FP8's scales do, and which loss scaler runs over sharded gradients",
          "softmax and normalisation in floating point", (("08_sensitive_ops", 2, 10), ("09_fp8", 2, 10)),
          ("10_scaling_out", "ddp")),
    Block("Wrap-up", 10, objectives="each group reports one claim from the ledger it would now dispute, and why"),
]


def _exercise_title(root: Path, stem: str, number: int) -> str:
    """The bold title of exercise `number` in a chapter's Exercises section."""
    text = (root / "chapters" / f"{stem}.md").read_text()
    section = text.split("## Exercises", 1)[-1]
    found = re.search(rf"^{number}\. \*\*(.+?)\*\*", section, re.M)
    return found.group(1) if found else f"exercise {number}"


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


def _projector(root: Path, site: Path | None, block: Block) -> list[str]:
    """The block's projector figure, copied from this build's results next to the page."""
    if block.figure is None:
        return []
    stem, name = block.figure
    source = root / "_build" / "results" / "figures" / f"{stem}-{name}.png"
    if not source.is_file():
        return [f"*Projector figure:* {{doc}}`../chapters/{stem}`'s figure `{name}` is not in this build.", ""]
    if site is not None:
        target = site / "appendix" / FIGURES / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.is_file() or target.read_bytes() != source.read_bytes():
            target.write_bytes(source.read_bytes())
    return [f"```{{figure}} {FIGURES}/{source.name}", ":width: 80%", "",
            f"For the projector: from {{doc}}`../chapters/{stem}`, as this build drew it.", "```", ""]


def page(root: Path, site: Path | None = None) -> str:
    """The workshop page; with `site`, the blocks' projector figures are copied next to it."""
    times = status.timings(root)
    measured_on_gpu = any(t["gpu"] is not None for t in times.values())

    def run_time(stem):
        here, gpu = times[stem]["build"], times[stem]["gpu"]
        shown = status.seconds(here) if here is not None else "not yet run"
        return f"{stem} ({shown}{f'; gpu, trimmed, {status.seconds(gpu)}' if gpu is not None else ''})"

    rows = [[b.name, f"{b.minutes} min", "; ".join(run_time(s) for s in b.chapters) or "–"] for b in PLAN]
    ran = {stem: t["build"] for stem, t in times.items() if t["build"] is not None}
    total = sum(ran.values())
    slowest = max(ran, key=ran.get, default=None)
    lines = [
        "# Workshop kit", "",
        f"A half-day plan ({sum(b.minutes for b in PLAN)} minutes). Minutes are for teaching and discussion; the run "
        "time beside each chapter is this build's own"
        + ("; GPU times come from committed reference runs (`results/gpu/`)." if measured_on_gpu else
           ". No GPU reference run is committed yet, so there are no GPU times.")
        + " The {doc}`build_status` page has each chapter's device and library versions.", "",
        status.table(["block", "minutes", "chapters (run time)"], rows), "",
        "## Before the day", "",
        "`make workshop-prep` builds the lab's models for every seed the chosen exercises use and runs the "
        "participants' check (`python -m bookbuild.workshop_check check`, under two minutes): library versions, "
        "bitsandbytes' 4-bit layer, one GRPO step of trl, and a chapter executed by papermill into the "
        "participant's own folder. Ask every participant to run the check on the machine they will bring.", "",
        "## The blocks", ""]
    for block in PLAN:
        if not block.objectives:
            continue
        lines += [f"### {block.name} ({block.minutes} min)", "", f"- *Objectives:* {block.objectives}."]
        if block.prerequisites:
            lines.append(f"- *Prerequisites:* {block.prerequisites}.")
        for stem, number, minutes in block.exercises:
            here = times.get(stem, {}).get("build")
            took = f"the chapter ran in {status.seconds(here)} in this build" if here is not None else "not yet run"
            lines.append(f"- *Exercise ({minutes} min):* {{doc}}`../chapters/{stem}`, exercise {number}, "
                         f"\"{_exercise_title(root, stem, number).rstrip('.')}\" ({took}).")
        lines.append("")
        lines += _projector(root, site, block)
        if "02_qlora_crash" in block.chapters:
            lines += _crash_on_gpu(root)
    lines += [
        "## A room without GPUs", "",
        f"Every chapter runs in the `cpu` profile; the whole book took {total / 60:.0f} minutes of chapter time in "
        f"this build (the slowest chapter, {slowest}, {status.seconds(ran.get(slowest))}), with the lab's models built "
        "by chapter 0 and cached. Run `make book` once before the session; participants re-run single chapters "
        "with other parameters into their own folders (see *Running a chapter yourself*), which never change "
        "the book's results. Cells that need CUDA say so and run "
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
        "the notebook, and saving writes the Markdown back. `make workshop-prep` checks that this path works.",
        "* **As the book runs it.** `python -m bookbuild.pipeline run STEM -p seed=1 --participant NAME` "
        "executes a chapter with other parameters into the participant's own folder (`_build/runs/NAME`). It "
        "accepts the cells that are meant to fail. A bare `papermill chapters/STEM.ipynb out.ipynb` runs every "
        f"cell too, but papermill ({_papermill()}) then exits with status 1 and puts an \"An Exception was "
        "encountered\" banner at the top of its output as soon as any cell raised, even one tagged "
        "`raises-exception`; the book's pipeline accepts those cells.", "",
        "## Solutions", "",
        "Every chapter ends with exercises run as predict, run, explain. Their solutions are not on the "
        "participants' pages: they are on the teachers' page, {doc}`solutions`, each with the numbers this "
        "build measured.", "",
        "## When a laptop cannot run a chapter", "",
        "* Pair the participant with a neighbour whose machine passed `python -m bookbuild.workshop_check check`.",
        "* Serve the built book (`python -m http.server -d _build/html`): every chapter's outputs are there, "
        "executed, so the participant can do the *predict* and *explain* steps of an exercise from them.",
        "* Open the chapter in Colab from its launch button, where the book is published from GitHub.",
        (f"* Skip the slowest chapters first: in this build {slowest} took {status.seconds(ran.get(slowest))}; "
         "the build-status page lists every chapter's time." if slowest else
         "* Skip the slowest chapters first: the build-status page lists every chapter's time."), ""]
    return "\n".join(lines)


def _papermill() -> str:
    """The installed papermill's version, as the page quotes it."""
    from importlib import metadata

    try:
        return f"{metadata.version('papermill')} here"
    except metadata.PackageNotFoundError:
        return "not installed here"
