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
    """Source of a notebook's first cell: clone the book at `commit` and install it with the library
    versions its results were measured with, only where `labutils` cannot be imported."""
    pins = ", ".join(f'"{name}=={versions[name]}"' for name in PINNED if versions.get(name))
    return f'''\
# Colab, or any kernel without the book's package: fetch the book at the commit these pages were
# built from and install it with the library versions they were measured with (Colab's own torch
# is kept). Where `labutils` is already importable this cell does nothing.
import importlib, importlib.util, os, subprocess, sys
if importlib.util.find_spec("labutils") is None:
    subprocess.run(["git", "clone", "-q", "https://github.com/{repo}", "{CLONE}"], check=True)
    subprocess.run(["git", "-C", "{CLONE}", "checkout", "-q", "{commit}"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "./{CLONE}", {pins}], check=True)
    os.chdir("{CLONE}")  # chapters find configs/ and write _build/results/ here, as in a checkout
    importlib.invalidate_caches()
'''


def notebook(source: Path, repo: str, commit: str, versions: dict[str, str]):
    """The chapter `source` (jupytext Markdown) as an unexecuted notebook for Colab: the install cell
    first, a GPU runtime requested, everything else as written."""
    import jupytext
    import nbformat

    nb = jupytext.read(source)
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
