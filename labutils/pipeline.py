"""Execute chapters with papermill (once, cached by fingerprint) and build the HTML book from them.

    python -m labutils.pipeline execute [--profile cpu] [STEM ...]
    python -m labutils.pipeline book [--profile auto]
    python -m labutils.pipeline bench
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import colab, ledger, workshop

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "_build"
SITE = BUILD / "site"  # the book's sources as Sphinx sees them: pages plus executed notebooks
PAGES = ("_toc.yml", "intro.md", "references.bib")


def chapters(root: Path = ROOT) -> list[str]:
    """Chapter stems in table-of-contents order."""
    return re.findall(r"chapters/([A-Za-z0-9_]+)", (root / "_toc.yml").read_text())


def resolve_profile(profile: str) -> str:
    """'auto' -> the profile a chapter would pick here (any other value goes to the chapter to reject)."""
    from . import profiles

    return profiles.resolve(profile).name if profile == "auto" else profile


def fingerprint(stem: str, parameters: dict, root: Path = ROOT) -> str:
    """Hash of a chapter's source, all of labutils, and its parameters."""
    digest = hashlib.sha256((root / "chapters" / f"{stem}.md").read_bytes())
    for module in sorted((root / "labutils").rglob("*.py")):
        digest.update(module.name.encode() + module.read_bytes())
    digest.update(json.dumps(parameters, sort_keys=True).encode())
    return digest.hexdigest()


def execute(stem: str, profile: str = "auto", parameters: dict | None = None, force: bool = False,
            root: Path = ROOT) -> Path:
    """Run one chapter with papermill unless its fingerprint is unchanged; returns the executed notebook."""
    import jupytext
    import papermill

    source = root / "chapters" / f"{stem}.md"
    if not source.is_file():
        raise FileNotFoundError(f"no chapter {source}; known chapters: {', '.join(chapters(root))}.")
    params = {"profile": resolve_profile(profile), **(parameters or {})}
    build = root / "_build"
    executed = build / "executed" / f"{stem}.ipynb"
    stamp = executed.with_suffix(".fingerprint")
    results_file = build / "results" / f"{stem}.json"
    key = fingerprint(stem, params, root)
    if not force and executed.is_file() and stamp.is_file() and stamp.read_text() == key \
            and results_fingerprint(results_file) == key:
        print(f"{stem}: unchanged, not executed again")
        return executed
    plain = build / "notebooks" / f"{stem}.ipynb"
    plain.parent.mkdir(parents=True, exist_ok=True)
    executed.parent.mkdir(parents=True, exist_ok=True)
    notebook = jupytext.read(source)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    jupytext.write(notebook, plain)
    stamp.unlink(missing_ok=True)
    os.environ["LAB_RESULTS_DIR"] = str(build / "results")
    start, began = time.perf_counter(), time.time()
    try:
        papermill.execute_notebook(str(plain), str(executed), parameters=params, kernel_name="python3",
                                   cwd=str(root), progress_bar=False)
    except papermill.PapermillExecutionError:
        _accept_expected_errors(executed)  # re-raises unless every error is in a `raises-exception` cell
    _check_required_errors(executed, _device(params["profile"]))
    _sign_results(results_file, key, since=began - 1)
    stamp.write_text(key)
    print(f"{stem}: executed in {time.perf_counter() - start:.1f} s ({params})")
    return executed


class ChapterError(RuntimeError):
    """A chapter cell failed that was not tagged `raises-exception`."""


def _accept_expected_errors(executed: Path) -> None:
    """papermill fails on any error output; keep the notebook if all errors were meant (tagged)."""
    import nbformat
    from papermill.execute import ERROR_MARKER_TAG

    notebook = nbformat.read(executed, as_version=4)
    notebook.cells = [c for c in notebook.cells if ERROR_MARKER_TAG not in c.metadata.get("tags", [])]
    for cell in notebook.cells:
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        if errors and "raises-exception" not in cell.metadata.get("tags", []):
            raise ChapterError(f"{executed.name}: a cell not tagged raises-exception failed with "
                               f"{errors[0].ename}: {errors[0].evalue}\n--- cell ---\n{cell.source}")
    nbformat.write(notebook, executed)


def results_fingerprint(path: Path) -> str | None:
    """The fingerprint a results file was signed with by the run that wrote it (None if unsigned or absent)."""
    try:
        return json.loads(path.read_text()).get("fingerprint")
    except (OSError, ValueError):
        return None


def _sign_results(path: Path, key: str, since: float) -> None:
    """Mark the results this execution wrote as belonging to this source and these parameters."""
    if not path.is_file() or path.stat().st_mtime < since:
        raise ChapterError(f"{path.name} was not written by this execution: the chapter must end with run.save().")
    data = json.loads(path.read_text())
    data["fingerprint"] = key
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


REQUIRED = {"error-required": ("cpu", "cuda"), "error-required-cuda": ("cuda",), "error-required-cpu": ("cpu",)}


def _device(profile: str) -> str:
    """The device a chapter computes on in `profile`."""
    from . import profiles

    return profiles.PROFILES[profile].device if profile in profiles.PROFILES else "cpu"


def _check_required_errors(executed: Path, device: str) -> None:
    """A cell tagged `error-required` (or `-cuda`, `-cpu`) must have raised on this device: a cell that
    shows an error only where it should cannot silently stop showing it."""
    import nbformat

    notebook = nbformat.read(executed, as_version=4)
    for index, cell in enumerate(notebook.cells):
        tags = cell.metadata.get("tags", [])
        required = [t for t in tags if t in REQUIRED and device in REQUIRED[t]]
        if required and not any(o.output_type == "error" for o in cell.get("outputs", [])):
            raise ChapterError(f"{executed.name}: cell {index} is tagged {required[0]} but raised nothing on "
                               f"{device}\n--- cell ---\n{cell.source}")


def _copy_if_changed(src: Path, dst: Path) -> None:
    """Copy keeping the destination untouched when equal, so Sphinx rebuilds only what changed."""
    if dst.is_file() and filecmp.cmp(src, dst, shallow=False):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def _write_if_changed(text: str, dst: Path) -> None:
    if dst.is_file() and dst.read_text() == text:
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text)


def stage(root: Path = ROOT) -> None:
    """Assemble the book's Sphinx sources: top-level pages and the executed chapters."""
    import yaml

    for page in PAGES:
        _copy_if_changed(root / page, SITE / page)
    config = yaml.safe_load((root / "_config.yml").read_text())
    repo = colab.repository(root)
    if repo:  # Colab launch buttons on every chapter page
        config |= colab.launch_config(repo)
    _write_if_changed(yaml.safe_dump(config, sort_keys=False), SITE / "_config.yml")
    for page in (root / "appendix").glob("*.md") if (root / "appendix").is_dir() else ():
        _copy_if_changed(page, SITE / "appendix" / page.name)
    for stem in chapters(root):
        _copy_if_changed(root / "_build" / "executed" / f"{stem}.ipynb", SITE / "chapters" / f"{stem}.ipynb")
    _stage_mathjax()
    # generated pages: read from this build's results, so their numbers are this run's
    _write_if_changed(ledger.page(root), SITE / "appendix" / "claims_ledger.md")
    _write_if_changed(workshop.page(root), SITE / "appendix" / "workshop.md")


def _stage_mathjax() -> None:
    """A local MathJax 3 (from the django-static-mathjax wheel's files), so the book's maths renders offline."""
    import importlib.util

    spec = importlib.util.find_spec("mathjax")
    source = Path(spec.submodule_search_locations[0]) / "static" / "mathjax" / "es5" if spec else None
    if source is None or not (source / "tex-mml-chtml.js").is_file():
        raise FileNotFoundError("MathJax files not found: install the book's dependencies "
                                "(pip install -e '.[book]', which brings django-static-mathjax).")
    target = SITE / "_vendor" / "mathjax"  # not _static: jupyter-book includes every .js found there
    _copy_if_changed(source / "tex-mml-chtml.js", target / "tex-mml-chtml.js")
    for part in ("input/tex/extensions", "output/chtml/fonts/woff-v2", "a11y", "ui", "adaptors"):
        for file in (source / part).rglob("*"):
            if file.is_file():
                _copy_if_changed(file, target / file.relative_to(source))


def build_html(root: Path = ROOT) -> Path:
    """Build the HTML from the staged sources, Sphinx warnings as errors; returns `_build/html`."""
    stage(root)
    html = jupyter_book(SITE, root)
    write_colab_notebooks(html, root)
    return html


def jupyter_book(site: Path, output: Path) -> Path:
    """`jupyter-book build` of the staged `site` into `output/_build/html`, Sphinx warnings as errors."""
    command = Path(sys.executable).with_name("jupyter-book")
    subprocess.run([str(command), "build", str(site), "--path-output", str(output), "-W",
                    "--keep-going", "--quiet"], check=True)
    return output / "_build" / "html"


def write_colab_notebooks(html: Path, root: Path = ROOT) -> list[Path]:
    """The chapters as Colab notebooks inside the built book (the pages branch serves them to Colab)."""
    import nbformat

    repo, commit = colab.repository(root), colab.revision(root)
    if not (repo and commit):
        print("Colab: no GitHub repository found (set BOOK_REPOSITORY=owner/name, or build in GitHub "
              "Actions); the book is built without Colab notebooks and launch buttons.")
        return []
    written = []
    for stem in chapters(root):
        result = root / "_build" / "results" / f"{stem}.json"
        versions = json.loads(result.read_text())["env"] if result.is_file() else {}
        target = html / colab.FOLDER / "chapters" / f"{stem}.ipynb"
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(colab.notebook(root / "chapters" / f"{stem}.md", repo, commit, versions), target)
        written.append(target)
    print(f"Colab: {len(written)} notebooks for {repo}@{commit[:12]} in {target.parent}")
    return written


def bench(root: Path = ROOT) -> float:
    """Print each chapter's own execution seconds from its results file; returns the total."""
    total = 0.0
    print(f"{'chapter':<24}{'profile':>8}{'seconds':>10}")
    for stem in chapters(root):
        path = root / "_build" / "results" / f"{stem}.json"
        if not path.is_file():
            print(f"{stem:<24}{'-':>8}{'not run':>10}")
            continue
        result = json.loads(path.read_text())
        total += result["seconds"]
        print(f"{stem:<24}{result['profile']:>8}{result['seconds']:>10.1f}")
    print(f"{'total':<24}{'':>8}{total:>10.1f}")
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("command", choices=("execute", "book", "bench"))
    parser.add_argument("stems", nargs="*", help="chapters to execute (default: all)")
    parser.add_argument("--profile", default="auto", help="auto, cpu or gpu")
    parser.add_argument("--force", action="store_true", help="execute even if unchanged")
    args = parser.parse_args(argv)
    if args.command == "bench":
        bench()
        return
    for stem in args.stems or chapters():
        execute(stem, args.profile, force=args.force)
    if args.command == "book":
        print(f"book: {build_html()}/index.html")


if __name__ == "__main__":
    main()
