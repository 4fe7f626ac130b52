"""The workshop page: a half-day plan whose run times are read from this build's results."""
from __future__ import annotations

from pathlib import Path

from .results import load_all

# (block, minutes of teaching and discussion, chapters run in it, what the room does)
PLAN = [
    ("Formats and the lab", 30, ["00_lab", "01_number_formats"],
     "read bf16/fp16/fp8 layouts off real casts; meet the task and the tiny models"),
    ("The crash", 30, ["02_qlora_crash", "03_loss_scaling", "11_troubleshooting"],
     "reproduce the QLoRA GRPO error, trace it into the libraries, predict it with preflight"),
    ("Break", 15, [], ""),
    ("The mismatch", 60, ["04_mismatch", "05_grpo_precision", "05b_sampler_precision"],
     "measure μ against π at 1,000+ tokens; run GRPO under precision pairs; turn the sampler's "
     "precision dial until RL on its samples degrades, and compare the fixes"),
    ("MoE and LoRA", 40, ["06_moe", "07_lora"],
     "count routing flips and lost LoRA updates"),
    ("Toolkit", 30, ["08_sensitive_ops", "09_fp8", "10_scaling_out"],
     "which operations need fp32, FP8 roles, multi-process launch and configs"),
    ("Wrap-up", 10, [], "each group reports one claim from the ledger it would now dispute"),
]


def page(root: Path) -> str:
    cpu, gpu = ({stem: data.get("seconds") for stem, data in load_all(root / folder).items()}
                for folder in ("_build/results", "results/gpu"))

    def fmt(table, stem):
        return f"{table[stem]:.0f} s" if table.get(stem) is not None else "not yet measured"

    rows = []
    for block, minutes, stems, activity in PLAN:
        run = "; ".join(f"{s} (cpu {fmt(cpu, s)}, gpu {fmt(gpu, s)})" for s in stems) or "–"
        rows.append(f"| {block} | {minutes} min | {run} | {activity or '–'} |")
    total_cpu = sum(v for v in cpu.values() if v)
    slowest = max(cpu, key=lambda stem: cpu[stem] or 0, default=None)
    return "\n".join([
        "# Workshop kit", "",
        f"A half-day plan ({sum(block[1] for block in PLAN)} minutes). Minutes are for teaching and discussion; the run times "
        "beside each chapter are this build's own measurements (`_build/results`), and GPU times "
        "come from committed reference runs (`results/gpu/`) when there are any.", "",
        "| block | minutes | chapters (run time) | what the room does |", "|---|---|---|---|", *rows, "",
        "## A room without GPUs", "",
        f"Every chapter runs in the `cpu` profile; the whole book took {total_cpu / 60:.0f} minutes in this "
        f"build (the slowest chapter, {slowest}, {fmt(cpu, slowest)}), with the lab's models built by "
        "chapter 0 and cached. Run `make book` once before the session, then let participants re-run single "
        "chapters with other parameters (README). Cells that need CUDA say so and run their CPU "
        "counterpart: the CUDA crash in chapter 2, FP8 tensor-core timing in chapter 9. The built book "
        "needs no network: serve `_build/html` (`python -m http.server -d _build/html`) on the room's machines.", "",
        "## On Colab", "",
        "Where the book is published from its GitHub repository, every chapter page has a launch button "
        "(the rocket at the top) that opens the chapter in Colab. Its first cell installs the book at the "
        "commit the page was built from, with the library versions it was measured with, and does nothing "
        "where the package is already installed. Choose a GPU runtime: on an L4 or A100 (bf16 arithmetic) "
        "`profile=\"auto\"` picks the `gpu` profile; on a T4 it picks the `cpu` profile and says why: "
        "a T4 has no bf16 arithmetic, so the bf16 side of every comparison would be emulated, not measured.", "",
        "## Exercises", "",
        "Every chapter ends with exercises; the solutions are folded under *Solutions* so a teacher "
        "can reveal them after the room has tried.", ""])

