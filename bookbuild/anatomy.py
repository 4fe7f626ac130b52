"""What a reader of a chapter meets: its prose words, its visible code, and how much of that code is bookkeeping.

    python -m bookbuild.anatomy        # one line per chapter

Visible code is code in cells not tagged `remove-input`, `remove-cell`, `hide-input`, `hide-cell` or
`parameters` (the build removes parameters cells from the page), comments and blank lines left out; the
widest line counts comments too, as the code box shows them. A visible line is *bookkeeping* when it glues or records a result or formats text
or a table: `glue(`, `.record(`, `display=False`, `.format(`, a format spec such as `:.2g`, an f-string,
`.map(`, `pd.DataFrame(` or `pd.Series(`. The experiment (engines, sampling, scoring, training, plots) is
what should remain visible. Prose words are the words outside code cells and directive options, a glued
value counting as one word.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .layout import ROOT, chapters

BOOKKEEPING = re.compile(r"\bglue\(|\.record\(|display=False|\.format\(|:\.\d+[gfe%]|f\"|f'|\.map\(|"
                         r"pd\.DataFrame\(|pd\.Series\(")
HIDDEN = re.compile(r"remove-input|remove-cell|hide-input|hide-cell|parameters")
WORDS_AT_MOST, BOOKKEEPING_AT_MOST, WIDTH_AT_MOST = 2500, 0.05, 93


@dataclass(frozen=True)
class Anatomy:
    words: int
    code_lines: int
    bookkeeping_lines: int
    widest_line: int
    opening_box: bool

    @property
    def bookkeeping_share(self) -> float:
        return self.bookkeeping_lines / self.code_lines if self.code_lines else 0.0


def measure(source: str) -> Anatomy:
    """The anatomy of one chapter's MyST source."""
    lines = source.split("\n")
    start = lines.index("---", 1) + 1 if lines and lines[0].strip() == "---" and "---" in lines[1:] else 0
    words = code = bookkeeping = widest = 0
    in_cell = hidden = False
    i = start
    while i < len(lines):
        line = lines[i]
        if line.startswith("```{code-cell}"):
            in_cell, hidden, i = True, False, i + 1
            while i < len(lines) and lines[i].startswith(":"):
                hidden |= bool(HIDDEN.search(lines[i]))
                i += 1
            continue
        if in_cell and line.startswith("```"):
            in_cell = False
        elif in_cell:
            if not hidden and line.strip():
                widest = max(widest, len(line))
                if not line.strip().startswith("#"):
                    code += 1
                    bookkeeping += bool(BOOKKEEPING.search(line))
        elif not line.startswith(("```", ":", "+++")):
            words += len(re.findall(r"[A-Za-z][A-Za-z'’-]*", re.sub(r"\{[a-z:]+\}`[^`]*`", " X ", line)))
        i += 1
    return Anatomy(words, code, bookkeeping, widest, "```{admonition} In short" in source)


def book(root: Path = ROOT) -> dict[str, Anatomy]:
    """Every chapter's anatomy, in reading order."""
    return {stem: measure((root / "chapters" / f"{stem}.md").read_text()) for stem in chapters(root)}


def main() -> None:
    print(f"{'chapter':26s} {'words':>6s} {'visible code':>13s} {'bookkeeping':>12s} {'widest':>7s}  box")
    for stem, a in book().items():
        print(f"{stem:26s} {a.words:6d} {a.code_lines:13d} {a.bookkeeping_share:12.0%} {a.widest_line:7d}  "
              f"{'yes' if a.opening_box else 'no'}")


if __name__ == "__main__":
    main()
