"""The exercises' solutions, kept apart from the participants' pages: a teacher's page of their own.

Each chapter writes its solutions beside its exercises, as a `{admonition} Solutions` block whose
numbers are glued by the chapter. Staging cuts the block out of the chapter's page and collects it,
with the glued numbers of that chapter's executed notebook filled in, on the teacher's page.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
from myst_nb.core.variables import format_plain_text

BLOCK = re.compile(r"^(`{3,})\{admonition\} Solutions\n(?::[^\n]*\n)*(.*?)^\1[ \t]*$\n?", re.M | re.S)
GLUE = re.compile(r"\{glue:text\}`([A-Za-z0-9_]+)(?::([^`]*))?`")
DOC = re.compile(r"\{doc\}`([^`./][^`]*)`")  # a link relative to the chapters' folder


def split(notebook: nbformat.NotebookNode) -> tuple[nbformat.NotebookNode, list[str]]:
    """The notebook without its solutions blocks, and the blocks' contents (fences and options dropped)."""
    page, found = nbformat.from_dict(notebook), []
    for cell in page.cells:
        if cell.cell_type != "markdown":
            continue
        found += [match.group(2).strip() for match in BLOCK.finditer(cell.source)]
        cell.source = BLOCK.sub("", cell.source).rstrip() + "\n" if BLOCK.search(cell.source) else cell.source
    page.cells = [cell for cell in page.cells if cell.cell_type != "markdown" or cell.source.strip()]
    return page, found


def glued(notebook: nbformat.NotebookNode) -> dict[str, str]:
    """Every value the notebook glued, as the text/plain its glue output holds."""
    values = {}
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            scrapbook = output.get("metadata", {}).get("scrapbook", {})
            plain = scrapbook.get("mime_prefix", "") + "text/plain"  # glue(display=False) prefixes its mime types
            if "name" in scrapbook and plain in output.get("data", {}):
                values[scrapbook["name"]] = output["data"][plain]
    return values


def fill(text: str, values: dict[str, str]) -> str:
    """`{glue:text}` roles replaced by their values, formatted by myst-nb's own formatter; links made to work
    from the appendix."""
    def value(match):
        name, spec = match.group(1), match.group(2)
        if name not in values:
            raise KeyError(f"the solutions quote {{glue:text}}`{name}`, which the chapter does not glue")
        return format_plain_text(values[name], spec or "s")  # as the chapter's own page formats it

    return DOC.sub(lambda m: f"{{doc}}`../chapters/{m.group(1)}`", GLUE.sub(value, text))


def page(chapters: list[tuple[str, str, list[str], dict[str, str]]], notes: list[str] = ()) -> str:
    """The teacher's page from (stem, title, solutions blocks, glued values) per chapter, after the workshop's
    teaching notes (`workshop.teachers`)."""
    lines = ["# Solutions, for teachers", "",
             "The workshop's teaching notes, then the exercises' solutions, out of the participants' pages. Each "
             "solution quotes the numbers its chapter measured in this build; a participant's own run (another "
             "seed, another machine) draws other numbers, and the reasoning, not the digits, is what should "
             "match.", ""]
    lines += list(notes)
    lines += ["## Solutions", ""]
    for stem, title, blocks, values in chapters:
        if not blocks:
            continue
        lines += [f"### {title}", "", f"Exercises of {{doc}}`../chapters/{stem}`.", ""]
        lines += [fill(block, values) + "\n" for block in blocks]
    return "\n".join(lines)


def title(notebook: nbformat.NotebookNode) -> str:
    """The notebook's `# Title`."""
    for cell in notebook.cells:
        if cell.cell_type == "markdown" and (found := re.search(r"^# (.+)$", cell.source, re.M)):
            return found.group(1).strip()
    return "untitled"
