"""The build-status page: when and from what the book was built, and each chapter's run.

Generated at build time from `_build/results/*.json` (and `results/gpu/*.json`, the committed GPU
reference runs), like the claims ledger. The workshop page reads its run times from `timings`.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from . import anatomy, colab
from .layout import chapters
from labutils.env import LIBRARIES, cpu_model, kernel_set
from labutils.results import load_all

# A chapter whose executed notebook is newer than this was executed by this process (this build);
# an older one was reused because its source, labutils and parameters were unchanged.
STARTED = time.time()
VERSIONS = ("Python", *LIBRARIES)


def table(header: list[str], rows: list[list]) -> str:
    """A MyST pipe table from rows of cells."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows])


def _runs(root: Path) -> tuple[dict, dict]:
    return load_all(root / "_build" / "results"), load_all(root / "results" / "gpu")


def timings(root: Path) -> dict[str, dict[str, float | None]]:
    """Each chapter's execution seconds in this build and in its GPU reference run, {stem: {"build": s,
    "gpu": s}}, None where not measured."""
    cpu, gpu = _runs(root)
    return {stem: {"build": cpu.get(stem, {}).get("seconds"), "gpu": gpu.get(stem, {}).get("seconds")}
            for stem in chapters(root)}


def seconds(value: float | None) -> str:
    """'12 s', '3.4 s' (a no-break space: a table cell never wraps the unit alone), or '–'."""
    return "–" if value is None else f"{value:.0f}\u00a0s" if value >= 10 else f"{value:.1f}\u00a0s"


def _device(env: dict) -> str:
    return env.get("device", "?") if env.get("device") != "cuda" else f"{env['device_name']} (CUDA {env.get('cuda')})"


def _how(stem: str, root: Path, ran: bool) -> tuple[str, str]:
    """('executed' by this build, 'cached' from an earlier one, or 'not run'; when it ran, UTC)."""
    notebook = root / "_build" / "executed" / f"{stem}.ipynb"
    if not ran or not notebook.is_file():
        return "not run", "–"
    mtime = notebook.stat().st_mtime
    return "executed" if mtime >= STARTED else "cached", time.strftime("%Y-%m-%d %H:%M", time.gmtime(mtime))


def _versions(runs: dict) -> tuple[dict, set]:
    """The library versions every run shares, and the names whose versions differ between runs."""
    envs = [data.get("env", {}) for data in runs.values()]
    differ = {lib for lib in VERSIONS if len({env.get(lib.lower()) for env in envs}) > 1}
    return {lib: envs[0].get(lib.lower()) for lib in VERSIONS if envs and lib not in differ}, differ


def _listing(versions: dict) -> str:
    return ", ".join(f"{lib} {version}" for lib, version in versions.items() if version)


def page(root: Path) -> str:
    """The build-status page as MyST Markdown."""
    cpu, gpu = _runs(root)
    stems = chapters(root)
    commit = colab.revision(root)
    shared, differ = _versions(cpu)
    header = ["chapter", "this build", "ran (UTC)", "profile", "device", "seconds"]
    header += [f"{lib} version" for lib in sorted(differ)]
    if gpu:
        header += ["gpu reference", "gpu seconds (trimmed profile)"]
    rows, how = [], {stem: _how(stem, root, stem in cpu) for stem in stems}
    for stem in stems:
        run = cpu.get(stem, {})
        env = run.get("env", {})
        row = [f"{{doc}}`{stem} <../chapters/{stem}>`", *how[stem], run.get("profile", "–"),
               _device(env) if env else "–", seconds(run.get("seconds"))]
        row += [env.get(lib.lower(), "–") for lib in sorted(differ)]
        if gpu:
            reference = gpu.get(stem)
            row += [_device(reference["env"]) if reference else "–", seconds(reference and reference.get("seconds"))]
        rows.append(row)

    def total(runs):
        return f"**{sum(runs[s]['seconds'] for s in stems if s in runs) / 60:.1f} min**"

    rows.append(["**total**", "", "", "", "", total(cpu), *[""] * len(differ)] + (["", total(gpu)] if gpu else []))
    kinds = [kind for kind, _ in how.values()]
    gpu_note = (f"GPU reference runs (committed in `results/gpu/`, executed on a GPU by `make gpu-check`, not by "
                f"this build; the gpu profile trimmed to fewer steps, seeds and sequences, so a full gpu-profile run "
                f"takes longer): "
                f"{_listing(_versions(gpu)[0])}." if gpu else
                "No GPU reference run is committed yet (`results/gpu/` is empty), so there are no GPU times.")
    return "\n".join([
        "# Build status", "",
        f"This copy of the book was built on {time.strftime('%Y-%m-%d at %H:%M UTC', time.gmtime())} from commit "
        f"`{commit[:12] if commit else 'unknown (not a git checkout)'}` on this machine: CPU {cpu_model()}, "
        f"{os.cpu_count()} cores, kernel set {kernel_set()} (the same seed draws other numbers under other "
        f"kernels). It executed {kinds.count('executed')} of the {len(stems)} chapters and reused "
        f"{kinds.count('cached')}, *cached*: their source, the `labutils` code and their parameters were unchanged "
        "since the run shown, so that run's notebook and results were kept"
        + (f"; {kinds.count('not run')} have not been run." if "not run" in kinds else "."), "",
        f"Library versions{' (the same in every chapter)' if len(cpu) > 1 and not differ else ''}: "
        f"{_listing(shared) or 'no chapter results yet'}.", "",
        "Each chapter's seconds are its own execution time, from its results file "
        "(`_build/results/<chapter>.json`); `make bench` prints the same numbers.", "",
        table(header, rows), "",
        gpu_note, "",
        "## What a reader meets", "",
        "Each chapter's prose words, visible code lines (cells not hidden, comments and blank lines left out) and "
        "the share of those lines that is bookkeeping (gluing or recording a result, formatting text or a table), "
        f"by `python -m bookbuild.anatomy`; the tests hold every chapter to at most {anatomy.WORDS_AT_MOST:,} words, "
        f"{anatomy.BOOKKEEPING_AT_MOST:.0%} bookkeeping and {anatomy.WIDTH_AT_MOST}-character visible lines.", "",
        table(["chapter", "prose words", "visible code lines", "bookkeeping", "opening box"],
              [[stem, a.words, a.code_lines, f"{a.bookkeeping_share:.0%}", "yes" if a.opening_box else "no"]
               for stem, a in anatomy.book(root).items()]), ""])
