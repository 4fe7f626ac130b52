"""The book as one PDF (`make pdf`), printed by headless Chromium from the built HTML.

Prints it from the book that tests/test_site.py builds (once per session), then reads it with
pypdfium2: at least one page per chapter, each chapter from a new page, every figure of the
executed chapters embedded with real pixels, the maths typeset, and the landing page's link to it
working. Saves the first page of a chapter with a figure as `_build/screenshots/pdf-<chapter>.png`.
Skipped without Chromium, like the browser test, unless LAB_REQUIRE_BROWSER=1.
"""
from __future__ import annotations

import json
import re
from html import unescape

import numpy as np
import pytest

from bookbuild import pdf, pipeline
from test_site import _need_chromium

HIDDEN = {"remove-cell", "remove-output", "hide-output"}  # outputs that a printed page does not show


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("’", "'")).strip()


def _chapters() -> dict[str, dict]:
    """Each chapter's title and the number of figures its executed notebook shows."""
    found = {}
    for stem in pipeline.chapters():
        cells = json.loads((pipeline.BUILD / "executed" / f"{stem}.ipynb").read_text())["cells"]
        title = next(line[2:] for cell in cells if cell["cell_type"] == "markdown"
                     for line in "".join(cell["source"]).splitlines() if line.startswith("# "))
        figures = sum("image/png" in output.get("data", {}) for cell in cells
                      if not HIDDEN & set(cell["metadata"].get("tags", [])) for output in cell.get("outputs", []))
        found[stem] = {"title": _plain(title), "figures": figures}
    return found


def _formulas(html) -> set[str]:
    """The TeX of every formula on the book's pages, with its delimiters, as it would print untypeset."""
    math = re.compile(r'class="math notranslate nohighlight">(.*?)</(?:span|div)>', re.S)
    return {_plain(unescape(tex)) for page in html.rglob("*.html") for tex in math.findall(page.read_text())}


@pytest.fixture(scope="module")
def book(built_book):
    """The printed book, opened with pypdfium2."""
    _need_chromium()
    import pypdfium2

    html = built_book
    document = pypdfium2.PdfDocument(pdf.print_book(html))
    yield html, document
    document.close()


def test_every_chapter_starts_a_page_and_keeps_its_figures(book):
    import pypdfium2

    html, document = book
    chapters = _chapters()
    texts = [_plain(page.get_textpage().get_text_range()) for page in document]
    assert len(texts) >= len(chapters) + 1, f"{len(texts)} pages for {len(chapters)} chapters"
    starts = {stem: next((i for i, text in enumerate(texts) if text.startswith(c["title"])), None)
              for stem, c in chapters.items()}
    assert None not in starts.values(), f"chapters that do not start a page: {starts}"
    assert list(starts.values()) == sorted(starts.values()), starts  # in the book's order
    formulas = _formulas(html)
    left = [tex for tex in formulas if tex in " ".join(texts)]
    assert formulas and not left, f"maths printed as TeX, not typeset: {left[:5]}"

    images = [[obj for obj in page.get_objects(filter=[pypdfium2.raw.FPDF_PAGEOBJ_IMAGE])] for page in document]
    assert sum(map(len, images)) >= sum(c["figures"] for c in chapters.values()) > 0
    stem = next(stem for stem, c in chapters.items() if c["figures"])  # the first chapter with a figure
    first = next(i for i in range(starts[stem], len(images)) if images[i])
    pixels = np.asarray(images[first][0].get_bitmap(render=False).to_pil().convert("L"), dtype=float)
    assert pixels.std() > 10, f"the first figure of {stem} (page {first + 1}) is flat"
    shots = pipeline.BUILD / "screenshots"
    shots.mkdir(exist_ok=True)
    page = document[first].render(scale=1.5).to_pil()
    page.save(shots / f"pdf-{stem}.png")
    assert np.asarray(page.convert("L"), dtype=float).std() > 10


def test_the_landing_page_links_to_the_pdf(book):
    html, _ = book
    assert 'href="book.pdf"' in (html / pdf.FIRST_PAGE).read_text()
    assert (html / "book.pdf").read_bytes() == (pipeline.BUILD / "book.pdf").read_bytes()
