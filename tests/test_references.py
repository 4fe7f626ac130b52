"""The bibliography parses, and every key the pages cite is in it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_cited_key_is_in_the_bibliography():
    from pybtex.database import parse_file

    keys = set(parse_file(str(ROOT / "references.bib")).entries)
    pages = [ROOT / "intro.md", *ROOT.glob("chapters/*.md"), *ROOT.glob("appendix/*.md")]
    cited = {key.strip() for page in pages
             for group in re.findall(r"\{cite(?::[a-z]+)?\}`([^`]+)`", page.read_text()) for key in group.split(",")}
    assert cited and cited <= keys, cited - keys
