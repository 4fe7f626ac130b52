"""A committed long run: a result file under results/long/ that a chapter reads instead of running it.

A run is worth showing only beside the code and the model that made it, so its file carries a
fingerprint of both: the contents of the labutils modules the run executes (followed through the
imports), the plan values it reads, and the model's identity. `load` returns the payload and, where
the fingerprint does not match this checkout, one sentence saying what to run.

    run = committed.Run("05c_update_direction", module="update_direction", make="make direction")
    payload, why_not = run.load(plan, model)
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import env

FOLDER = Path(__file__).resolve().parent
RESULTS = FOLDER.parent / "results" / "long"


def modules_run(name: str) -> list[str]:
    """The labutils modules `name` executes: itself and everything it imports from the package, followed
    through the source (lazy imports inside functions included)."""
    found, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module in found or not (FOLDER / f"{module}.py").is_file():
            continue
        found.add(module)
        for node in ast.walk(ast.parse((FOLDER / f"{module}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                todo += [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
    return sorted(found)


def _plain(value):
    """A plan's dataclasses (a profile's parts) as the dicts JSON can hold."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} cannot be written into a committed run's file.")


@dataclass(frozen=True)
class Run:
    """One committed run: the file it writes, the module whose code it is, the command that makes it."""

    name: str
    module: str
    make: str

    @property
    def target(self) -> Path:
        return RESULTS / f"{self.name}.json"

    def fingerprint(self, plan: dict) -> str:
        """A hash of the modules the run executes and of the plan's values (which stand in for the profiles
        module's text, so that a chapter's own sizes can change without making the run stale)."""
        digest = hashlib.sha256()
        for module in modules_run(self.module):
            if module != "profiles":
                digest.update(module.encode() + b"\0" + (FOLDER / f"{module}.py").read_bytes())
        for field, value in sorted(plan.items()):
            digest.update(field.encode() + b"\0" + repr(value).encode())
        return digest.hexdigest()[:16]

    def stale(self, payload: dict, plan: dict, model: str) -> str | None:
        """Why the committed file cannot be shown beside this checkout (one sentence), or None."""
        made = payload.get("provenance", {})
        if made.get("code") != self.fingerprint(plan) or made.get("model") != model:
            return (f"The committed {self.name} run was made by other code, another plan or another model than "
                    f"this checkout's: run `{self.make}` and commit {self.target.relative_to(FOLDER.parent)}.")
        return None

    def load(self, plan: dict, model: str) -> tuple[dict | None, str | None]:
        """The committed payload and, where it cannot be used, why."""
        if not self.target.is_file():
            return None, f"No committed {self.name} run: run `{self.make}` and commit its file."
        payload = json.loads(self.target.read_text())
        return payload, self.stale(payload, plan, model)

    def write(self, payload: dict, plan: dict, model: str, began: float, target: Path | None = None,
              code: str | None = None) -> Path:
        """`payload` with its plan, its minutes and its provenance, written where the chapter reads it. `code`: the
        fingerprint taken when the run began (the files may change while it runs); by default, taken now."""
        target = target or self.target
        payload = {**payload, "plan": plan, "minutes": (time.time() - began) / 60,
                   "provenance": {"code": code or self.fingerprint(plan), "model": model, "modules": modules_run(self.module),
                                  "date": time.strftime("%Y-%m-%d", time.gmtime(began)), "cpu": env.cpu_model(),
                                  "kernel_set": env.kernel_set(), "torch_threads": torch.get_num_threads(),
                                  "env": env.env_report()}}
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(payload, indent=1, default=_plain) + "\n")
        return target
