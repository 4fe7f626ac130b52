"""The results contract: one JSON per chapter with its profile, run time, environment and metrics."""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from pathlib import Path

from .env import env_report


def project_root(start: Path | None = None) -> Path | None:
    """The nearest folder up from `start` (or the working directory) holding `_toc.yml`."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "_toc.yml").is_file():
            return folder
    return None


def results_dir() -> Path:
    """`LAB_RESULTS_DIR` (the pipeline sets it), else a participant's own `_build/runs/<name>/results`.

    Only the pipeline writes the book's `_build/results`: a chapter run by hand (papermill, Jupyter)
    with whatever parameters goes to `$LAB_PARTICIPANT`'s folder (`mine` by default).
    """
    if "LAB_RESULTS_DIR" in os.environ:
        return Path(os.environ["LAB_RESULTS_DIR"])
    return (project_root() or Path.cwd()) / "_build" / "runs" / participant() / "results"


def participant(name: str | None = None) -> str:
    """`name`, else $LAB_PARTICIPANT, else "mine": one plain folder name, never a path out of `_build/runs`."""
    name = name or os.environ.get("LAB_PARTICIPANT") or "mine"
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", name):
        raise ValueError(f"participant {name!r} is not a folder name; use letters, digits, '_' or '-' "
                         "(and '.' after the first character).")
    return name


def flatten(metrics: dict, prefix: str = "") -> dict:
    """Nested dicts to flat dotted keys; numbers to plain Python numbers."""
    flat = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = _plain(value)
    return flat


def _plain(value):
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or inf
    return value


class ChapterRun:
    """Collects a chapter's metrics; `save()` writes `<results>/<chapter>.json` atomically."""

    def __init__(self, chapter: str, profile: str):
        self.chapter, self.profile = chapter, profile
        self.started = time.perf_counter()
        self.env = env_report()
        self.metrics: dict = {}

    def record(self, **metrics) -> None:
        """Add metrics; nested dicts become dotted keys (`record(eps={"float16": ...})`)."""
        self.metrics.update(flatten(metrics))

    def __getitem__(self, key: str):
        value = self.metrics[key]
        return float(value) if value in ("nan", "inf", "-inf") else value  # stored as text: JSON has none

    def table(self, keys: list[str] | None = None, notes: dict | None = None, labels: dict | None = None):
        """`metrics_table` of this run's metrics, with the chapter's GPU reference run beside them if committed."""
        return metrics_table(self.metrics, keys, notes, chapter=self.chapter, labels=labels)

    def save(self) -> Path:
        """Write the results; in a notebook, also glue `chapter_seconds` for the page's time-to-run line."""
        seconds = time.perf_counter() - self.started
        folder = results_dir()
        folder.mkdir(parents=True, exist_ok=True)
        payload = {"chapter": self.chapter, "profile": self.profile, "seconds": round(seconds, 3),
                   "env": self.env, "metrics": self.metrics}
        target = folder / f"{self.chapter}.json"
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{self.chapter}-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=1, sort_keys=True)
        os.replace(tmp, target)
        try:
            from myst_nb import glue
        except ImportError:  # outside the book's environment there is no page to glue into
            pass
        else:
            glue("chapter_seconds", round(seconds), display=False)
        return target


def load(chapter: str, folder: Path | None = None) -> dict:
    """A chapter's results file as a dict."""
    return json.loads(((folder or results_dir()) / f"{chapter}.json").read_text())


def load_all(folder: Path) -> dict:
    """Every results file in `folder` (none if it does not exist), by chapter."""
    found = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        data = json.loads(path.read_text())
        found[data.get("chapter", path.stem)] = data
    return found


def gpu_reference(chapter: str) -> dict | None:
    """The committed GPU reference results of a chapter (`results/gpu/<chapter>.json`), if any."""
    root = project_root() or Path.cwd()
    path = root / "results" / "gpu" / f"{chapter}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def metrics_table(metrics: dict, keys: list[str] | None = None, notes: dict | None = None,
                  chapter: str | None = None, labels: dict | None = None):
    """A table of metrics (all, or `keys` in order): this run, what the sources say where `notes` is given,
    and the committed GPU reference run of `chapter` beside them where `results/gpu/` has one;
    `labels` (key -> words) names each row for a reader instead of by its key."""
    from .tables import show  # pandas only where a table is shown

    keys = list(metrics) if keys is None else keys
    columns, rows = ["metric", "this run"], [[k, metrics[k]] for k in keys]
    if labels is not None:
        columns[0] = "quantity"
    if notes is not None:
        columns.append("the sources say")
        for row in rows:
            row.append(notes.get(row[0], ""))
    gpu = gpu_reference(chapter) if chapter else None
    caption = None
    if gpu:
        run = gpu.get("provenance", {})
        columns.append(f"GPU: {run.get('gpu', gpu['env'].get('device_name'))}")
        for row in rows:
            row.append(gpu["metrics"].get(row[0]))
        caption = (f"GPU column: results/gpu/{chapter}.json, the gpu profile"
                   f"{' trimmed (fewer steps, seeds and sequences)' if run.get('trimmed') else ''} on "
                   f"{run.get('gpu', '?')}, CUDA {run.get('cuda', '?')}, {run.get('date', '?')[:10]}.")
    if labels is not None:
        for row, key in zip(rows, keys):
            row[0] = labels.get(key, key)
    return show(rows, columns=columns, caption=caption)


def provenance(chapter: str, folder: Path | None = None):
    """A one-paragraph Markdown record of how the saved results of `chapter` were produced; where a GPU
    reference run is committed, also a table of every metric both runs recorded, side by side."""
    from IPython.display import Markdown

    data = load(chapter, folder)
    env = data["env"]
    device = env.get("cpu", env["device_name"]) if env["device"] == "cpu" else f"{env['device_name']} (CUDA {env['cuda']})"
    kernels = f", kernels {env['kernels']}" if env["device"] == "cpu" and env.get("kernels") else ""
    libraries = ", ".join(f"{lib} {env[lib]}" for lib in ("torch", "transformers", "trl", "peft", "accelerate",
                                                          "bitsandbytes") if lib in env)
    record = Markdown(f"*Provenance:* `{data['profile']}` profile on {env['device']} ({device}{kernels}), "
                      f"Python {env['python']}, {libraries}; executed in {data['seconds']:.1f} s. "
                      f"Every number on this page comes from this run "
                      f"(`{_relative(folder or results_dir())}/{chapter}.json`).")
    gpu = gpu_reference(chapter)
    if not gpu:
        return record
    from IPython.display import display

    display(record)
    shared = [k for k, v in data["metrics"].items() if k in gpu["metrics"] and not isinstance(v, list)]
    return metrics_table(data["metrics"], shared, chapter=chapter)  # this run beside the committed GPU run


def _relative(folder: Path) -> str:
    """A results folder as a reader should see it: inside the project, not the build machine's path."""
    root = project_root()
    try:
        return str(Path(folder).resolve().relative_to(root)) if root else str(folder)
    except ValueError:
        return str(folder)
