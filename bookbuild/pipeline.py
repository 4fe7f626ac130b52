"""Execute chapters with papermill (once, cached by fingerprint) and build the HTML book from them.

    python -m bookbuild.pipeline execute [--profile cpu] [STEM ...]
    python -m bookbuild.pipeline book [--profile auto]
    python -m bookbuild.pipeline bench
"""
from __future__ import annotations

import argparse
import contextlib
import filecmp
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import colab, findings, ledger, pdf, solutions, status, warm, workshop
from .layout import BUILD, PAGES, ROOT, SITE, chapters


def resolve_profile(profile: str) -> str:
    """'auto' -> the profile a chapter would pick here (any other value goes to the chapter to reject)."""
    from labutils import profiles

    return profiles.resolve(profile).name if profile == "auto" else profile


def fingerprint(stem: str, parameters: dict, root: Path = ROOT) -> str:
    """Hash of a chapter's source, the labutils code chapters run (the build's own code is not in it), the
    committed long runs they read, its parameters and the environment."""
    digest = hashlib.sha256((root / "chapters" / f"{stem}.md").read_bytes())
    for module in sorted((root / "labutils").rglob("*.py")):
        digest.update(module.name.encode() + module.read_bytes())
    for run in sorted((root / "results" / "long").glob("*.json")):
        digest.update(run.name.encode() + run.read_bytes())
    digest.update(json.dumps(parameters, sort_keys=True).encode())
    digest.update(json.dumps(environment(), sort_keys=True).encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def environment() -> dict:
    """What else decides a chapter's numbers: the libraries' installed versions and the CPU's kernel set.
    Results from another environment are executed again, never published."""
    from labutils import env

    return {"libraries": {name: env.installed_version(name) for name in env.LIBRARIES}, "kernels": env.kernel_set()}


def execute(stem: str, profile: str = "auto", parameters: dict | None = None, force: bool = False,
            root: Path = ROOT, build: Path | None = None) -> Path:
    """Run one chapter with papermill unless its fingerprint is unchanged; returns the executed notebook.

    Notebooks and results go to `build` (the book's `_build` by default; a participant's own runs
    go to `own_build(...)`, so they never reach the book).
    """
    import jupytext
    import papermill

    source = root / "chapters" / f"{stem}.md"
    if not source.is_file():
        raise FileNotFoundError(f"no chapter {source}; known chapters: {', '.join(chapters(root))}.")
    params = {"profile": resolve_profile(profile), **(parameters or {})}
    build = build or root / "_build"
    executed = build / "executed" / f"{stem}.ipynb"
    stamp = executed.with_suffix(".fingerprint")
    results_file = build / "results" / f"{stem}.json"
    key = fingerprint(stem, params, root)
    if not force and up_to_date(stem, params, build, root):
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
    if os.environ.get(warm.SOCKET):  # execute_all's warm server is up: the kernel is forked from it too
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(_warm_kernelspec(build / "warm" / stem)),
                                                                   os.environ.get("JUPYTER_PATH")]))
    start, began = time.perf_counter(), time.time()
    try:
        papermill.execute_notebook(str(plain), str(executed), parameters=params, kernel_name="python3",
                                   cwd=str(root), progress_bar=False, request_save_on_cell_execute=False)
    except papermill.PapermillExecutionError:
        _accept_expected_errors(executed)  # re-raises unless every error is in a `raises-exception` cell
    _check_required_errors(executed, _run_device(results_file, params["profile"]))
    _hide_machine_paths(executed, root)
    _sign_results(results_file, key, since=began - 1)
    stamp.write_text(key)
    print(f"{stem}: executed in {time.perf_counter() - start:.1f} s ({params})")
    return executed


def up_to_date(stem: str, params: dict, build: Path, root: Path = ROOT) -> bool:
    """The executed notebook and its results in `build` both belong to this source and these parameters."""
    executed = build / "executed" / f"{stem}.ipynb"
    stamp = executed.with_suffix(".fingerprint")
    key = fingerprint(stem, params, root)
    return executed.is_file() and stamp.is_file() and stamp.read_text() == key \
        and results_fingerprint(build / "results" / f"{stem}.json") == key


class ChapterError(RuntimeError):
    """A chapter cell failed that was not tagged `raises-exception`."""


FAILED = "chapters failed:"  # how the command line reports a ChapterError, on the last line


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


def _warm_kernelspec(folder: Path) -> Path:
    """A `python3` kernelspec under `folder` (for JUPYTER_PATH) that starts the kernel through bookbuild.warm."""
    spec = {"argv": [sys.executable, "-m", "bookbuild.warm", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3", "language": "python"}
    (folder / "kernels" / "python3").mkdir(parents=True, exist_ok=True)
    (folder / "kernels" / "python3" / "kernel.json").write_text(json.dumps(spec))
    return folder


def _run_device(results_file: Path, profile: str) -> str:
    """The device the run computed on, as its results file records it (else as `profile` resolves here)."""
    try:
        return json.loads(results_file.read_text())["env"]["device"]
    except (OSError, ValueError, KeyError, TypeError):
        return _device(profile)


def _device(profile: str) -> str:
    """The device a chapter computes on in `profile` here."""
    from labutils import profiles

    try:
        return profiles.resolve(profile).device
    except ValueError:  # the chapter refused this profile itself
        return "cpu"


def own_build(participant: str | None = None, root: Path = ROOT) -> Path:
    """Where a participant's own runs go (`_build/runs/<name>`): never the book's results."""
    from labutils.results import participant as checked

    return root / "_build" / "runs" / checked(participant)


LAST_RUN = {"warm": False}  # whether execute_all's last run forked its processes from a warm server
BOOK_FIRST = "00_lab"  # the book starts here
WITHOUT_MODELS = ("01_number_formats", "11_troubleshooting")  # need none of the lab's models
LONGEST = ("04b_real_mismatch", "05b_sampler_precision", "04_mismatch")  # first, in this order, where no last run says how long each takes


def execute_all(stems: list[str], profile: str = "auto", jobs: int = 2, force: bool = False,
                build: Path | None = None, root: Path = ROOT, warm_start: bool = True) -> float:
    """Execute `stems` `jobs` at a time, each in a process of its own; returns the wall seconds.

    For the whole book the lab's models are built first, each kind in a process of its own (beside the
    chapters that need none); then every chapter, the longest last run first (without a last run, LONGEST
    first). With `jobs` > 1 every process is single-threaded, so two do not fight over the cores, and (with
    `warm_start`) forked from a server that imported the heavy libraries once (`bookbuild.warm`); `jobs=1`
    runs everything one after another in fresh processes with torch's default threads.
    """
    start = time.perf_counter()
    build = build or root / "_build"
    models_first = BOOK_FIRST in stems and _resolves(profile)  # the book's build: its models before its chapters
    if not force:
        unchanged = [s for s in stems if up_to_date(s, {"profile": resolve_profile(profile)}, build, root)]
        for stem in unchanged:
            print(f"{stem}: unchanged, not executed again")
        stems = [s for s in stems if s not in unchanged]
        if not stems:
            return time.perf_counter() - start
    env = dict(os.environ)
    if jobs > 1:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with warm.server(env) if warm_start and jobs > 1 else contextlib.nullcontext() as socket_path:
        if socket_path:  # every process below is forked from a server that imported the libraries once
            env[warm.SOCKET] = socket_path
        LAST_RUN["warm"] = bool(socket_path)
        _execute_all(stems, profile, jobs, force, build, root, env, ["bookbuild.warm"] if socket_path else [],
                     models_first)
    return time.perf_counter() - start


def _execute_all(stems, profile, jobs, force, build, root, env, launcher, models_first) -> None:
    import concurrent.futures

    hint = [build / "results", root / "_build" / "results"]  # a fresh build folder orders by the book's last run
    order = sorted(stems, key=lambda s: (s not in WITHOUT_MODELS, -max(_last_seconds(d / f"{s}.json") for d in hint),
                                         LONGEST.index(s) if s in LONGEST else len(LONGEST)))
    models: dict = {}
    futures: dict = {}

    def run(command: list[str], what: str) -> None:
        done = subprocess.run([sys.executable, "-m", *launcher, *command], env=env, cwd=root, capture_output=True, text=True)
        print(done.stdout, end="")
        if done.returncode:
            print(done.stderr, file=sys.stderr)
            raise ChapterError(f"{what}: {_error_line(done)}")

    def build_model(kind: str) -> None:
        run(["labutils.models", kind, "--profile", profile], f"the lab's {kind} model")

    def one(stem: str) -> None:
        if stem not in WITHOUT_MODELS:
            for kind, future in models.items():  # waits for the models; without them the chapter fails too
                if future.exception() is not None:
                    raise ChapterError(f"{stem}: not run, the lab's {kind} model was not built")
        run(["bookbuild.pipeline", "execute", stem, "--profile", profile, "--build", str(build), "--root", str(root)]
            + (["--force"] if force else []), stem)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        if models_first:
            from labutils.models import KINDS
            from labutils.pretrained import installed

            models.update({kind: pool.submit(build_model, kind) for kind in (*KINDS, *["real"] * installed())})
        for stem in order:
            futures[stem] = pool.submit(one, stem)
    failed = [str(future.exception()) for future in [*models.values(), *futures.values()]
              if future.exception() is not None]
    if failed:  # every other chapter has finished: one failure does not cost the rest
        raise ChapterError("; ".join(failed))


def _resolves(profile: str) -> bool:
    """Whether `profile` runs here; where it does not, each chapter says so itself."""
    from labutils import profiles

    try:
        profiles.resolve(profile)
    except ValueError:
        return False
    return True


def _error_line(done: subprocess.CompletedProcess) -> str:
    """The last error line a failed process printed (or its exit status)."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
    return (errors or lines or [f"exited with {done.returncode}"])[-1]


def _last_seconds(path: Path) -> float:
    try:
        return float(json.loads(path.read_text())["seconds"])
    except (OSError, ValueError, KeyError):
        return 0.0


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


def _hide_machine_paths(executed: Path, root: Path) -> None:
    """Tracebacks and warnings name files by this machine's paths; a reader sees them relative to the
    project and to site-packages instead."""
    import site
    import sysconfig

    import nbformat

    prefixes = sorted({sysconfig.get_paths()["purelib"], *site.getsitepackages()}, key=len, reverse=True)
    swaps = [(prefix.rstrip("/") + "/", "<site-packages>/") for prefix in prefixes] + [(str(root) + "/", "")]

    def clean(text: str) -> str:
        for old, new in swaps:
            text = text.replace(old, new)
        return text

    notebook = nbformat.read(executed, as_version=4)
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                output.text = clean(output.text)
            elif output.output_type == "error":
                output.traceback = [clean(line) for line in output.traceback]
    nbformat.write(notebook, executed)


PARAMETER_TAGS = ("parameters", "injected-parameters")  # the chapter's defaults, and what papermill ran it with


def hide_parameters(notebook):
    """The notebook with its parameters cells (the chapter's own and papermill's injected one) tagged
    `remove-cell`: the page shows what the run measured, and its provenance line says with what parameters.
    Papermill's tags stay, so the notebook can still be run with other parameters."""
    for cell in notebook.cells:
        tags = cell.metadata.get("tags", [])
        if any(tag in tags for tag in PARAMETER_TAGS) and "remove-cell" not in tags:
            cell.metadata["tags"] = [*tags, "remove-cell"]
    return notebook


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
    import nbformat
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
    for diagram in (root / "appendix" / "diagrams").glob("*.svg"):  # drawn by hand, shown by pages and chapters
        _copy_if_changed(diagram, SITE / "appendix" / "diagrams" / diagram.name)
    taught = []  # each chapter's solutions, cut from its page for the teacher's page
    for stem in chapters(root):
        executed = nbformat.read(root / "_build" / "executed" / f"{stem}.ipynb", as_version=4)
        participants, blocks = solutions.split(hide_parameters(executed))
        _write_if_changed(nbformat.writes(participants), SITE / "chapters" / f"{stem}.ipynb")
        taught.append((stem, solutions.title(executed), blocks, solutions.glued(executed)))
    _write_if_changed(solutions.page(taught, workshop.teachers(ROOT)), SITE / "appendix" / "solutions.md")
    _stage_mathjax()
    # generated pages: read from this build's results, so their numbers are this run's
    _write_if_changed(findings.page(root, SITE), SITE / "findings.md")
    _write_if_changed(ledger.page(root), SITE / "appendix" / "claims_ledger.md")
    _write_if_changed(workshop.page(root, SITE), SITE / "appendix" / "workshop.md")
    _write_if_changed(status.page(root), SITE / "appendix" / "build_status.md")
    # the book's own styles (print, dark mode, the ledger), listed in _config.yml's html_css_files; into
    # _vendor, as a _static folder makes jupyter-book add every .js of the static paths (MathJax's) to each page
    for css in (root / "_static").glob("*.css"):
        _copy_if_changed(css, SITE / "_vendor" / css.name)


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
    html = output / "_build" / "html"
    for page in html.rglob("*.html"):
        text = page.read_text()
        softened = soften_table_code(text)
        if softened != text:
            page.write_text(softened)
    return html


TABLE = re.compile(r"<table\b.*?</table>", re.S)
CODE = re.compile(r"(<code\b[^>]*>)(.*?)(</code>)", re.S)
BREAK_AFTER = re.compile(r"([_=,(/]|\.(?!\d))")  # not inside a number: 1.0


def soften_table_code(html: str) -> str:
    """Code inside tables with a line-break opportunity (`<wbr>`) after each `.`, `_`, `=`, `,`, `(` and
    `/`, so a long setting wraps between its parts (`GRPOConfig(fp16=` / `True)`), not inside a word.
    Tags and their attributes are left as they are; running it twice changes nothing."""
    def code(match: re.Match) -> str:
        parts = re.split(r"(<[^>]+>)", match.group(2))
        inner = "".join(part if part.startswith("<") else BREAK_AFTER.sub(r"\1<wbr>", part) for part in parts)
        return match.group(1) + re.sub(r"(?:<wbr>)+", "<wbr>", inner) + match.group(3)

    return TABLE.sub(lambda table: CODE.sub(code, table.group(0)), html)


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
    total, ratios = 0.0, {}
    print(f"{'chapter':<24}{'profile':>8}{'seconds':>10}")
    for stem in chapters(root):
        path = root / "_build" / "results" / f"{stem}.json"
        if not path.is_file():
            print(f"{stem:<24}{'-':>8}{'not run':>10}")
            continue
        result = json.loads(path.read_text())
        total += result["seconds"]
        print(f"{stem:<24}{result['profile']:>8}{result['seconds']:>10.1f}")
        ratios.update({k: v for k, v in result["metrics"].items() if ".sample_over_forward." in k})
    print(f"{'total':<24}{'':>8}{total:>10.1f}")
    for key, ratio in sorted(ratios.items()):  # sampling's tokens/s as a share of a plain forward's (chapter 4b)
        print(f"{key:<48}{ratio:>10.0%}")
    return total


def compare(jobs: int = 2, root: Path = ROOT) -> float:
    """The whole book executed twice from scratch, the old way (serially, fresh processes) and the new (`jobs` at
    a time, forked from a warm server); prints both and the ratio."""
    import tempfile

    stems = chapters(root)
    cache = os.environ.get("LAB_CACHE")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
            os.environ["LAB_CACHE"] = f"{scratch}/serial-cache"  # each pass builds the lab's models itself
            serial = execute_all(stems, "cpu", jobs=1, force=True, build=Path(scratch) / "serial", root=root,
                                 warm_start=False)  # the old way: one at a time, each process fresh
            os.environ["LAB_CACHE"] = f"{scratch}/concurrent-cache"
            concurrent = execute_all(stems, "cpu", jobs=jobs, force=True, build=Path(scratch) / "concurrent",
                                     root=root)
            how = "from the warm server" if LAST_RUN["warm"] else "in fresh processes (no warm server)"
    finally:
        os.environ.pop("LAB_CACHE", None)
        if cache is not None:
            os.environ["LAB_CACHE"] = cache
    print(f"whole book, cpu profile: serial in fresh processes {serial:.0f} s, {jobs} at a time {how} "
          f"{concurrent:.0f} s: {serial / concurrent:.2f}x faster")
    return serial / concurrent


def _parameter(text: str) -> tuple[str, object]:
    """`key=value` -> (key, value), the value read as a Python literal where it is one (`seed=1`, `steps=4`)."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not key=value (for example -p seed=1).")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("command", choices=("execute", "book", "bench", "pdf", "run"))
    parser.add_argument("stems", nargs="*", help="chapters to execute (default: all)")
    parser.add_argument("--profile", default="auto", help="auto, cpu or gpu")
    parser.add_argument("--force", action="store_true", help="execute even if unchanged")
    parser.add_argument("--jobs", type=int, default=2, help="chapters executed at a time (after chapter 0)")
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--compare", action="store_true", help="bench: serial against --jobs at a time")
    parser.add_argument("-p", dest="parameters", action="append", type=_parameter, default=[],
                        help="run: a chapter parameter, key=value (repeatable)")
    parser.add_argument("--participant", help="run: whose runs folder (_build/runs/<name>; default $LAB_PARTICIPANT)")
    args = parser.parse_args(argv)
    if args.parameters and args.command != "run":
        parser.error("-p sets a participant's parameters: use it with `run` (the book's build takes none).")
    if args.command == "bench":
        compare(args.jobs) if args.compare else bench()
        return
    if args.command == "run":  # a participant's run: its own folder, other parameters, never the book's results
        if len(args.stems) != 1:
            parser.error("run takes one chapter, e.g. `run 04_mismatch -p seed=1`.")
        build = own_build(args.participant)
        execute(args.stems[0], args.profile, dict(args.parameters), force=True, build=build)
        print(f"results: {build / 'results' / (args.stems[0] + '.json')}")
        return
    if args.command == "execute" and len(args.stems) == 1:
        execute(args.stems[0], args.profile, force=args.force, root=args.root, build=args.build)
    else:
        try:
            seconds = execute_all(args.stems or chapters(), args.profile, jobs=args.jobs, force=args.force,
                                  build=args.build)
        except ChapterError as err:
            sys.exit(f"{FAILED} {err}")
        print(f"executed in {seconds:.0f} s, {args.jobs} chapters at a time")
    if args.command == "book":
        print(f"book: {build_html()}/index.html")
    if args.command == "pdf":  # the HTML book, then the same pages printed to one PDF

        print(f"pdf: {pdf.print_book(build_html(ROOT))}")


if __name__ == "__main__":
    main()
