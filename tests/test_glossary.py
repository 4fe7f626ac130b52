"""Every {term} a page links to is a term of the glossary, and the glossary defines each term once."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def glossary_entries() -> list[str]:
    """The terms defined inside the glossary page's `{glossary}` blocks (a term line, then indented text)."""
    terms = []
    for block in re.findall(r"```\{glossary\}\n(.*?)\n```", (ROOT / "appendix" / "glossary.md").read_text(), re.S):
        terms += [line.strip().lower() for line in block.splitlines() if line.strip() and not line.startswith(" ")]
    return terms


def glossary_terms() -> set[str]:
    return set(glossary_entries())


def test_no_term_is_defined_twice():
    """Sphinx stops the book's build on a duplicate term; this finds it in a second, not after the chapters."""
    entries = glossary_entries()
    assert len(entries) == len(set(entries)), sorted({t for t in entries if entries.count(t) > 1})


def test_every_linked_term_is_defined():
    pages = [ROOT / "intro.md", *ROOT.glob("chapters/*.md"), *ROOT.glob("appendix/*.md")]
    linked = {(m.group(2) or m.group(1)).strip().lower() for page in pages
              for m in re.finditer(r"\{term\}`([^`<]+?)(?:\s*<([^>]+)>)?`", page.read_text())}
    assert linked and linked <= glossary_terms(), linked - glossary_terms()
