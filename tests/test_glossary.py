"""Every {term} a page links to is a term of the glossary."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def glossary_terms() -> set[str]:
    """The terms defined inside the glossary page's `{glossary}` blocks (a term line, then indented text)."""
    terms = set()
    for block in re.findall(r"```\{glossary\}\n(.*?)\n```", (ROOT / "appendix" / "glossary.md").read_text(), re.S):
        terms |= {line.strip().lower() for line in block.splitlines() if line.strip() and not line.startswith(" ")}
    return terms


def test_every_linked_term_is_defined():
    pages = [ROOT / "intro.md", *ROOT.glob("chapters/*.md"), *ROOT.glob("appendix/*.md")]
    linked = {(m.group(2) or m.group(1)).strip().lower() for page in pages
              for m in re.finditer(r"\{term\}`([^`<]+?)(?:\s*<([^>]+)>)?`", page.read_text())}
    assert linked and linked <= glossary_terms(), linked - glossary_terms()
