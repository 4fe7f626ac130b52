"""The built HTML book, served on localhost and loaded page by page in headless Chromium.

Fails on a JavaScript error, a request that fails or answers 4xx/5xx, an image that does not load,
and a figure that is empty (no image, or an image of one flat colour). Saves screenshots of the
landing page and one chapter to `_build/screenshots/`.

Needs Debian's chromium (`make browser` installs it as root); without it the test is skipped,
unless LAB_REQUIRE_BROWSER=1 (CI), where a missing browser is a failure.
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from labutils import colab, pipeline

CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
# Offline machine: without these Chromium keeps trying to reach Google's services.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
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


def _pages(html: Path) -> list[str]:
    return sorted(str(p.relative_to(html)) for p in html.rglob("*.html")
                  if not p.relative_to(html).parts[0].startswith("_"))


def _need_chromium() -> None:
    if Path(CHROMIUM).is_file():
        return
    if os.environ.get("LAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make browser` (installs Debian's chromium) or set CHROMIUM.")
    pytest.skip(f"no Chromium at {CHROMIUM}; `make browser` installs Debian's chromium")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _served(directory: Path):
    """`directory` served on a free localhost port; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def check_site(html: Path, screenshots: dict[str, Path] | None = None) -> dict[str, list[str]]:
    """Load every page of `html` in headless Chromium; returns the problems found on each page."""
    from playwright.sync_api import sync_playwright

    problems: dict[str, list[str]] = {}
    with _served(html) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        found: list[str] = []
        page.on("pageerror", lambda err: found.append(f"page error: {err}"))
        page.on("requestfailed", lambda req: found.append(f"request failed: {req.url} ({req.failure})"))
        page.on("response", lambda r: found.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
        for path in _pages(html):
            found.clear()
            page.goto(f"{base}/{path}", wait_until="load")
            redirect = REDIRECT.search((html / path).read_text()[:200])
            if redirect:  # jupyter-book's index.html: follow it; the target is checked as its own page
                page.wait_for_url(f"{base}/{redirect.group(1)}")
                continue
            found += page.evaluate(INSPECT_IMAGES)
            if found:
                problems[path] = list(found)
            if path in (screenshots or {}):
                page.screenshot(path=str(screenshots[path]))
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


def _built_book() -> Path:
    for stem in pipeline.chapters():
        pipeline.execute(stem, profile="cpu")  # a no-op when the chapter tests already ran them
    return pipeline.build_html()


def test_every_page_of_the_book_loads_cleanly_in_chromium():
    _need_chromium()
    html = _built_book()
    pages = _pages(html)
    assert {LANDING, "appendix/claims_ledger.html", SCREENSHOT_CHAPTER} <= set(pages), pages
    shots = pipeline.BUILD / "screenshots"
    shots.mkdir(exist_ok=True)
    problems = check_site(html, {LANDING: shots / "landing.png",
                                 SCREENSHOT_CHAPTER: shots / f"{Path(SCREENSHOT_CHAPTER).stem}.png"})
    assert not problems, "\n".join(f"{page}: {p}" for page, ps in problems.items() for p in ps)
    assert (shots / "landing.png").stat().st_size > 10_000


def test_with_a_repository_every_chapter_has_a_working_colab_button(tmp_path):
    """The same book built with launch buttons (as GitHub Actions builds it): each chapter page links
    to its Colab notebook on the pages branch (written into the build where the repository is real),
    and the pages stay clean."""
    _need_chromium()
    _built_book()
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
