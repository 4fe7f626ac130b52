"""The book as one PDF, printed from its HTML by headless Chromium (no LaTeX).

    python -m bookbuild.pipeline pdf   # the HTML book, then _build/book.pdf (and a copy in _build/html)

Sphinx's `singlehtml` builder puts the whole book on one page, styled like the HTML book;
`_static/book.css` holds its print rules (A4, no navigation, each chapter from a new page).
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .layout import ROOT, SITE

CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
# Offline machine: without these Chromium keeps trying to reach Google's services.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FIRST_PAGE = "intro.html"  # singlehtml's index.html only redirects here


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def served(directory: Path):
    """`directory` served on a free localhost port (MathJax's fonts do not load from file://); yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def single_page(site: Path, output: Path) -> Path:
    """`jupyter-book build --builder singlehtml` of the staged `site` into `output`; returns its folder."""
    command = Path(sys.executable).with_name("jupyter-book")
    subprocess.run([str(command), "build", str(site), "--builder", "singlehtml", "--path-output", str(output),
                    "-W", "--keep-going", "--quiet"], check=True)
    return output / "_build" / "singlehtml"


def print_pdf(url: str, target: Path, chromium: str = CHROMIUM) -> Path:
    """Print the page at `url` to `target` with headless Chromium, after its scripts (MathJax) have run."""
    if not Path(chromium).is_file():
        raise FileNotFoundError(f"no Chromium at {chromium}: `make browser` installs Debian's chromium, "
                                "or set CHROMIUM=/path/to/chrome.")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no state from an earlier run
        subprocess.run([chromium, *CHROMIUM_ARGS, f"--user-data-dir={profile}", f"--print-to-pdf={target}",
                        "--no-pdf-header-footer", "--virtual-time-budget=60000",
                        "--run-all-compositor-stages-before-draw", url],
                       check=True, capture_output=True, timeout=900)
    if not target.is_file():
        raise RuntimeError(f"Chromium printed no PDF from {url}")
    return target


def print_book(html: Path, root: Path | None = None) -> Path:
    """`_build/book.pdf` printed from the one-page version of the staged book whose HTML is `html`,
    and copied into `html`, where the landing page links to it. Returns `_build/book.pdf`."""
    root = root or ROOT
    single = single_page(SITE, root / "_build" / "pdf")
    target = root / "_build" / "book.pdf"
    with served(single) as base:
        print_pdf(f"{base}/{FIRST_PAGE}", target)
    shutil.copyfile(target, html / "book.pdf")
    return target
