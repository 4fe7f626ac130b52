"""The results contract: one JSON per chapter with its profile, run time, environment and metrics."""
from __future__ import annotations

import json
import math
import os
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
    """`LAB_RESULTS_DIR`, else `<project>/_build/results`, else `./_build/results`."""
    if "LAB_RESULTS_DIR" in os.environ:
        return Path(os.environ["LAB_RESULTS_DIR"])
    return (project_root() or Path.cwd()) / "_build" / "results"


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
        return self.metrics[key]

    def save(self) -> Path:
        folder = results_dir()
        folder.mkdir(parents=True, exist_ok=True)
        payload = {"chapter": self.chapter, "profile": self.profile,
                   "seconds": round(time.perf_counter() - self.started, 3),
                   "env": self.env, "metrics": self.metrics}
        target = folder / f"{self.chapter}.json"
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{self.chapter}-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=1, sort_keys=True)
        os.replace(tmp, target)
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


def markdown_table(metrics: dict, keys: list[str] | None = None, notes: dict | None = None) -> str:
    """A markdown table of metrics (all, or `keys` in order), with an optional column of notes."""
    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    keys = list(metrics) if keys is None else keys
    if notes is None:
        rows = [f"| {k} | {cell(metrics[k])} |" for k in keys]
        return "| metric | this run |\n|---|---|\n" + "\n".join(rows)
    rows = [f"| {k} | {cell(metrics[k])} | {notes.get(k, '')} |" for k in keys]
    return "| metric | this run | the sources say |\n|---|---|---|\n" + "\n".join(rows)


def provenance(chapter: str, folder: Path | None = None):
    """A one-paragraph Markdown record of how the saved results of `chapter` were produced."""
    from IPython.display import Markdown

    data = load(chapter, folder)
    env = data["env"]
    device = env["device_name"] if env["device"] == "cpu" else f"{env['device_name']} (CUDA {env['cuda']})"
    libraries = ", ".join(f"{lib} {env[lib]}" for lib in ("torch", "transformers", "trl", "peft", "accelerate",
                                                          "bitsandbytes") if lib in env)
    return Markdown(f"*Provenance:* `{data['profile']}` profile on {env['device']} ({device}), "
                    f"Python {env['python']}, {libraries}; executed in {data['seconds']:.1f} s. "
                    f"Every number on this page comes from this run (`_build/results/{chapter}.json`).")
