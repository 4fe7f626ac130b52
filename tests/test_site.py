"""The built HTML book, served on localhost and loaded page by page in headless Chromium.

Fails on a JavaScript error, a request that fails or answers 4xx/5xx, an image that does not load,
a figure that is empty (no image, or an image of one flat colour), a table wider than its column at
a 1,280-px window, and a parameters cell a reader can see. Saves screenshots of the landing page and
one chapter, and each page's table widths, to `_build/screenshots/`.

Needs Debian's chromium (`make browser` installs it as root); without it the test is skipped,
unless LAB_REQUIRE_BROWSER=1 (CI), where a missing browser is a failure.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from bookbuild import colab, ledger, pipeline
from bookbuild.pdf import CHROMIUM, CHROMIUM_ARGS, served

REDIRECT = re.compile(r'<meta http-equiv="Refresh" content="0; url=([^"]+)"', re.I)
LANDING = "intro.html"  # index.html only redirects here
SCREENSHOT_CHAPTER = "chapters/04_mismatch.html"

# Runs in the page: every <img> and every figure-like output, judged after the page has loaded.
INSPECT_IMAGES = """() => {
  const flat = (img) => {
    const c = document.createElement('canvas');
    c.width = Math.min(img.naturalWidth, 256); c.height = Math.min(img.naturalHeight, 256);
    const g = c.getContext('2d'); g.drawImage(img, 0, 0, c.width, c.height);
    const d = g.getImageData(0, 0, c.width, c.height).data;
    for (let i = 4; i < d.length; i += 4)
      if (d[i] !== d[0] || d[i+1] !== d[1] || d[i+2] !== d[2] || d[i+3] !== d[3]) return false;
    return true;
  };
  const problems = [];
  for (const img of document.querySelectorAll('img')) {
    const src = img.getAttribute('src');
    if (!img.complete || img.naturalWidth === 0) problems.push(`image did not load: ${src}`);
    else if (img.closest('.cell_output, figure') && flat(img)) problems.push(`empty figure (one colour): ${src}`);
  }
  for (const fig of document.querySelectorAll('figure'))
    if (!fig.querySelector('img, svg')) problems.push('figure without an image');
  return problems;
}"""


# Runs in a page: every table (hidden outputs opened, as a reader may open them) against the width it
# has without scrolling sideways: its nearest box that clips or scrolls, at most the article's column.
# And any parameters cell, the chapter's own or papermill's injected one, that takes up room on the page.
INSPECT_LAYOUT = """() => {
  for (const d of document.querySelectorAll('details')) d.open = true;
  for (const e of document.querySelectorAll('.toggle-hidden')) e.classList.remove('toggle-hidden');
  const column = document.querySelector('article') || document.body;
  const room = (el) => {
    let box = el.parentElement;
    while (box && box !== column && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
    return Math.min((box || column).clientWidth, column.clientWidth);
  };
  const tables = [], problems = [];
  for (const table of column.querySelectorAll('table')) {
    if (!table.getClientRects().length) continue;
    const width = Math.round(table.getBoundingClientRect().width), fits = room(table);
    const name = (table.querySelector('caption') || table.querySelector('th') || table).textContent
      .replace(/\\s+/g, ' ').trim().slice(0, 50);
    tables.push({name, width, room: fits});
    if (width > fits + 1) problems.push(`table ${width} px wide in a ${fits} px column: "${name}"`);
  }
  for (const cell of document.querySelectorAll('.cell.tag_parameters, .cell.tag_injected-parameters'))
    if (cell.getClientRects().length)
      problems.push(`visible parameters cell: ${cell.textContent.replace(/\\s+/g, ' ').trim().slice(0, 60)}`);
  return {problems, tables};
}"""
PARAMETERS_CELL = re.compile(r'class="cell tag_(injected-)?parameters docutils container"')


# Runs in the claims ledger: where the first claim's cells sit against what can be seen without
# scrolling sideways: the window, and the table's own scrolling box (the theme wraps wide tables in one).
LEDGER_FIRST_ROW = """() => {
  const table = document.querySelector('table.claims-ledger');
  const cells = [...table.querySelector('tbody tr').children];
  const verdict = cells[1].querySelector('.sd-badge') || cells[1];
  const box = (e) => { const r = e.getBoundingClientRect(); return [Math.round(r.left), Math.round(r.right)]; };
  const scroller = table.closest('.pst-scrollable-table-container') || table;
  return {visible: Math.min(window.innerWidth, box(scroller)[1]), pageWidth: document.documentElement.scrollWidth,
          verdict: verdict.textContent.trim(), verdictBox: box(verdict), cellBoxes: cells.map(box)};
}"""

# Runs in a page in dark mode: text whose colour does not stand out from the background behind it
# (WCAG contrast under 4.5), and figures not shown as intended: matplotlib plots are drawn on white,
# so each sits on a white card (white background, padding) that matches the plot's own white corner.
INSPECT_DARK_MODE = """() => {
  const rgba = (s) => { const m = s.match(/[\\d.]+/g).map(Number); return m.length === 3 ? [...m, 1] : m; };
  const lum = (c) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
                       return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]); };
  const contrast = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const behind = (el) => {
    for (let e = el; e; e = e.parentElement) { const c = rgba(getComputedStyle(e).backgroundColor); if (c[3] > 0.5) return c; }
    return [255, 255, 255, 1];
  };
  const problems = [];
  if (document.documentElement.dataset.theme !== 'dark') problems.push('the page is not in dark mode');
  let texts = 0;
  for (const el of document.querySelectorAll('article *')) {
    const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!own || el.getBoundingClientRect().width === 0 || getComputedStyle(el).visibility === 'hidden') continue;
    texts += 1;
    const [fg, bg] = [rgba(getComputedStyle(el).color), behind(el)];
    const ratio = contrast(fg, bg);
    if (ratio < 4.5 && problems.length < 20)
      problems.push(`text at contrast ${ratio.toFixed(1)} (rgb ${fg.slice(0, 3)} on ${bg.slice(0, 3)}): ` +
                    `${el.tagName.toLowerCase()} "${el.textContent.trim().slice(0, 40)}"`);
  }
  const figures = [...document.querySelectorAll('article .cell_output img, article figure img')];
  for (const img of figures) {
    const style = getComputedStyle(img), card = rgba(style.backgroundColor);
    const c = document.createElement('canvas'); c.width = c.height = 1;
    c.getContext('2d').drawImage(img, 0, 0, 1, 1, 0, 0, 1, 1);
    const corner = [...c.getContext('2d').getImageData(0, 0, 1, 1).data];
    if (Math.min(...card.slice(0, 3)) < 250 || card[3] < 1 || parseFloat(style.paddingTop) < 4)
      problems.push(`figure not on a white card: ${img.getAttribute('src')}`);
    else if (Math.min(...corner) < 250)
      problems.push(`figure whose own background is not the card's white: ${img.getAttribute('src')}`);
  }
  return {problems, texts, figures: figures.length, tables: document.querySelectorAll('article table').length};
}"""


def _pages(html: Path) -> list[str]:
    return sorted(str(p.relative_to(html)) for p in html.rglob("*.html")
                  if not p.relative_to(html).parts[0].startswith("_"))


def _need_chromium() -> None:
    if Path(CHROMIUM).is_file():
        return
    if os.environ.get("LAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make browser` (installs Debian's chromium) or set CHROMIUM.")
    pytest.skip(f"no Chromium at {CHROMIUM}; `make browser` installs Debian's chromium")


def check_site(html: Path, screenshots: dict[str, Path] | None = None,
               tables: dict[str, list[dict]] | None = None) -> dict[str, list[str]]:
    """Load every page of `html` in headless Chromium at 1,280 px; returns the problems found on each page
    (and fills `tables`, where given, with each page's tables: name, width and the room it has, in px)."""
    from playwright.sync_api import sync_playwright

    problems: dict[str, list[str]] = {}
    with served(html) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        found: list[str] = []
        page.on("pageerror", lambda err: found.append(f"page error: {err}"))
        # a request the browser cancels itself (a font still loading when the next page opens) is not a
        # fault of the page; a missing file shows as its HTTP status
        page.on("requestfailed", lambda req: None if req.failure == "net::ERR_ABORTED"
                else found.append(f"request failed: {req.url} ({req.failure})"))
        page.on("response", lambda r: found.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
        for path in _pages(html):
            found.clear()
            page.goto(f"{base}/{path}", wait_until="load")
            redirect = REDIRECT.search((html / path).read_text()[:200])
            if redirect:  # jupyter-book's index.html: follow it; the target is checked as its own page
                page.wait_for_url(f"{base}/{redirect.group(1)}")
                continue
            found += page.evaluate(INSPECT_IMAGES)
            if path in (screenshots or {}):  # as a reader first sees it, before the outputs are opened
                page.screenshot(path=str(screenshots[path]))
            layout = page.evaluate(INSPECT_LAYOUT)
            found += layout["problems"]
            if tables is not None:
                tables[path] = layout["tables"]
            if found:
                problems[path] = list(found)
        browser.close()
    return problems


def test_the_check_catches_a_broken_page(tmp_path):
    """A page with a script error, a missing image and a one-colour figure: all three are reported."""
    _need_chromium()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.imsave(tmp_path / "flat.png", np.ones((8, 8)), cmap="gray")
    plt.imsave(tmp_path / "plot.png", np.arange(64.0).reshape(8, 8))
    (tmp_path / "broken.html").write_text(
        '<img src="missing.png"><figure><img src="flat.png"></figure><script>undefinedCall()</script>')
    (tmp_path / "fine.html").write_text('<figure><img src="plot.png"></figure>')
    problems = check_site(tmp_path)
    assert set(problems) == {"broken.html"}, problems
    text = "\n".join(problems["broken.html"])
    assert "HTTP 404" in text and "image did not load: missing.png" in text
    assert "empty figure (one colour): flat.png" in text and "page error" in text


def test_the_check_catches_a_table_wider_than_its_column_and_a_visible_parameters_cell(tmp_path):
    """In a 600-px column: a table 900 px wide (also one inside a closed <details>, and one that scrolls in
    its own box) and a visible parameters cell are reported; a table that wraps to fit, and a parameters cell
    the page does not show, are not."""
    _need_chromium()
    wide = '<table><tr><th>wide</th><td style="white-space:nowrap">{}</td></tr></table>'.format("x" * 150)
    fits = '<table><tr><th>fits</th><td>{}</td></tr></table>'.format("word " * 150)
    page = '<html><body><article style="width:600px">{}</article></body></html>'
    (tmp_path / "wide.html").write_text(page.format(
        wide + f'<details><summary>output</summary>{wide}</details>'
        f'<div style="overflow-x:auto">{wide}</div>'
        '<div class="cell tag_injected-parameters docutils container"><pre>profile = "cpu"</pre></div>'))
    (tmp_path / "fine.html").write_text(page.format(
        fits + '<div class="cell tag_parameters docutils container" style="display:none">seed = 0</div>'))
    tables: dict = {}
    problems = check_site(tmp_path, tables=tables)
    assert set(problems) == {"wide.html"}, problems
    text = "\n".join(problems["wide.html"])
    assert text.count('in a 600 px column: "wide"') == 3, text
    assert 'visible parameters cell: profile = "cpu"' in text, text
    assert [t["name"] for t in tables["fine.html"]] == ["fits"] and tables["fine.html"][0]["width"] <= 600


def test_the_build_hides_parameters_cells_and_marks_break_points_in_table_code():
    """Staging tags the chapter's and papermill's parameters cells `remove-cell` (keeping papermill's tags);
    the built pages' table code gets a `<wbr>` after `.`, `_`, `=`, `,`, `(` and `/`, not inside a number,
    nor outside tables or inside tags, and a second pass changes nothing."""
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("profile = 'auto'"),
                                               nbformat.v4.new_code_cell("profile = 'cpu'"),
                                               nbformat.v4.new_code_cell("x = 1")])
    for cell, tags in zip(notebook.cells, (["parameters"], ["injected-parameters"], [])):
        cell.metadata["tags"] = tags
    tags = [cell.metadata["tags"] for cell in pipeline.hide_parameters(notebook).cells]
    assert tags == [["parameters", "remove-cell"], ["injected-parameters", "remove-cell"], []]
    page = ('<p><code>a.b</code></p><table><tr><td><code class="docutils literal notranslate">'
            '<span class="pre">GRPOConfig(fp16=True,</span> <span class="pre">lr=1.5e-5)</span></code></td></tr></table>')
    soft = pipeline.soften_table_code(page)
    assert soft == ('<p><code>a.b</code></p><table><tr><td><code class="docutils literal notranslate">'
                    '<span class="pre">GRPOConfig(<wbr>fp16=<wbr>True,<wbr></span> <span class="pre">lr=<wbr>1.5e-5)'
                    '</span></code></td></tr></table>')
    assert pipeline.soften_table_code(soft) == soft


def test_every_page_of_the_book_loads_cleanly_in_chromium(built_book):
    _need_chromium()
    html = built_book
    pages = _pages(html)
    assert {LANDING, "appendix/claims_ledger.html", SCREENSHOT_CHAPTER} <= set(pages), pages
    shots = pipeline.BUILD / "screenshots"
    shots.mkdir(exist_ok=True)
    tables: dict = {}
    problems = check_site(html, {LANDING: shots / "landing.png",
                                 SCREENSHOT_CHAPTER: shots / f"{Path(SCREENSHOT_CHAPTER).stem}.png"}, tables)
    (shots / "tables-1280.json").write_text(json.dumps(tables, indent=1))  # each page's widths, for a reader
    assert not problems, "\n".join(f"{page}: {p}" for page, ps in problems.items() for p in ps)
    assert (shots / "landing.png").stat().st_size > 10_000
    assert sum(map(len, tables.values())) > 50, tables  # the check saw the book's tables
    shown = [path for path in pages if PARAMETERS_CELL.search((html / path).read_text())]
    assert not shown, f"pages with a parameters cell: {shown}"


def test_with_a_repository_every_chapter_has_a_working_colab_button(tmp_path, built_book):
    """The same book built with launch buttons (as GitHub Actions builds it): each chapter page links
    to its Colab notebook on the pages branch (written into the build where the repository is real),
    and the pages stay clean."""
    _need_chromium()
    repo = colab.repository(pipeline.ROOT) or "someone/precision-lab"
    site = tmp_path / "site"
    shutil.copytree(pipeline.SITE, site)
    config = yaml.safe_load((site / "_config.yml").read_text()) | colab.launch_config(repo)
    (site / "_config.yml").write_text(yaml.safe_dump(config))
    html = pipeline.jupyter_book(site, tmp_path)
    pipeline.write_colab_notebooks(html)
    for stem in pipeline.chapters():
        page = (html / "chapters" / f"{stem}.html").read_text()
        assert f'href="{colab.colab_url(repo, stem)}"' in page, f"{stem}: no Colab button"
        if colab.repository(pipeline.ROOT):  # notebooks are written only where the repository is real
            assert (html / colab.FOLDER / "chapters" / f"{stem}.ipynb").is_file()
    problems = check_site(html)
    assert not problems, "\n".join(f"{page}: {p}" for page, ps in problems.items() for p in ps)


def _page(browser, base: str, path: str, width: int, dark: bool = False):
    """A page of the book in a fresh browser context `width` pixels wide, in the theme's dark mode if asked."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    if dark:  # what the theme's mode switch stores
        context.add_init_script("localStorage.setItem('mode', 'dark'); localStorage.setItem('theme', 'dark');")
    page = context.new_page()
    page.goto(f"{base}/{path}", wait_until="load")
    return page


# every table cell whose text is a number, and whose text lies on more than one line
BROKEN_NUMBERS = """(selector) => [...document.querySelectorAll(selector + ' td')].filter(td => {
  const text = td.textContent.trim();
  if (!/^[-+−]?[0-9][0-9.,]*$/.test(text)) return false;
  const walker = document.createTreeWalker(td, NodeFilter.SHOW_TEXT), tops = new Set();
  while (walker.nextNode()) {  // the lines the text itself sits on, not the boxes around it
    const range = document.createRange(); range.selectNodeContents(walker.currentNode);
    for (const r of range.getClientRects()) if (r.width > 0) tops.add(Math.round(r.top));
  }
  return tops.size > 1;
}).map(td => td.textContent.trim())"""


def test_the_ledger_shows_each_verdict_without_horizontal_scrolling(built_book):
    """At a 1280-px window and a 390-px phone, the first claim's verdict (and the rest of its row) lies
    inside the window, and the page does not scroll sideways."""
    _need_chromium()
    from playwright.sync_api import sync_playwright

    html, shots = built_book, pipeline.BUILD / "screenshots"
    shots.mkdir(exist_ok=True)
    first = ledger.entries(pipeline.ROOT)[0]["verdict"].split(" (")[0]
    with served(html) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for width in (1280, 390):
            page = _page(browser, base, "appendix/claims_ledger.html", width)
            seen = page.evaluate(LEDGER_FIRST_ROW)
            page.locator("table.claims-ledger").scroll_into_view_if_needed()
            page.screenshot(path=str(shots / f"claims_ledger-{width}.png"))
            assert seen["verdict"] == first, seen
            assert seen["visible"] <= width and seen["pageWidth"] <= width, (width, seen)
            assert 0 <= seen["verdictBox"][0] and seen["verdictBox"][1] <= seen["visible"], (width, seen)
            assert all(0 <= left and right <= seen["visible"] for left, right in seen["cellBoxes"]), (width, seen)
            broken = page.evaluate(BROKEN_NUMBERS, "table.claims-ledger")
            assert not broken, (width, broken)  # "1 / 0" for claim 10: a number split over two lines
            page.context.close()
        browser.close()


DARK_PAGES = ("chapters/04_mismatch.html", "chapters/05b_sampler_precision.html")


def check_dark_mode(html: Path, paths, screenshots: Path | None = None) -> dict[str, dict]:
    """Load `paths` of `html` in the theme's dark mode; returns what INSPECT_DARK_MODE found on each."""
    from playwright.sync_api import sync_playwright

    found = {}
    with served(html) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for path in paths:
            page = _page(browser, base, path, 1280, dark=True)
            found[path] = page.evaluate(INSPECT_DARK_MODE)
            if screenshots:  # the first figure, where a reader would judge the card
                figure = page.locator(".cell_output img").first
                if figure.count():
                    figure.scroll_into_view_if_needed()
                page.screenshot(path=str(screenshots / f"dark-{Path(path).stem}.png"))
            page.context.close()
        browser.close()
    return found


def test_the_dark_mode_check_catches_dark_text_and_unframed_figures(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.imsave(tmp_path / "plot.png", np.pad(np.arange(64.0).reshape(8, 8), 2, constant_values=100.0), cmap="gray")
    page = ('<html data-theme="dark"><body style="background:#14181e;color:#ced6dd"><article>{}'
            '<div class="cell_output"><img src="plot.png" style="{}"></div></article></body></html>')
    (tmp_path / "bad.html").write_text(page.format('<p style="color:#000">black on dark</p>', ""))
    (tmp_path / "good.html").write_text(page.format("<p>light on dark</p>", "background:#fff;padding:8px"))
    found = check_dark_mode(tmp_path, ["bad.html", "good.html"])
    assert found["good.html"]["problems"] == [] and found["good.html"]["figures"] == 1, found
    bad = "\n".join(found["bad.html"]["problems"])
    assert 'p "black on dark"' in bad and "figure not on a white card: plot.png" in bad, bad


def test_in_dark_mode_text_tables_and_figures_stay_legible(built_book):
    """Two chapters in the theme's dark mode: all text (prose, code, table cells) stands out from what is
    behind it, and every figure sits on a white card that matches the plot's own white."""
    _need_chromium()
    html, shots = built_book, pipeline.BUILD / "screenshots"
    shots.mkdir(exist_ok=True)
    found = check_dark_mode(html, DARK_PAGES, shots)
    for path, seen in found.items():
        assert not seen["problems"], f"{path}:\n" + "\n".join(seen["problems"])
        assert seen["texts"] > 100, (path, seen)
    assert sum(seen["figures"] for seen in found.values()) >= 2 and sum(seen["tables"] for seen in found.values()) >= 2
