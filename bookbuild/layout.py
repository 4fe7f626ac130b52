"""Where the book's sources and build live, and its chapters in reading order."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "_build"
SITE = BUILD / "site"  # the book's sources as Sphinx sees them: pages plus executed notebooks
PAGES = ("_toc.yml", "intro.md", "references.bib")


def chapters(root: Path = ROOT) -> list[str]:
    """Chapter stems in table-of-contents order."""
    return re.findall(r"chapters/([A-Za-z0-9_]+)", (root / "_toc.yml").read_text())
