import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from labutils import models, profiles
from bookbuild import pipeline


@pytest.fixture
def tiny_profile():
    """A profile small enough to build a model in about a second."""
    cpu = profiles.PROFILES["cpu"]
    size = profiles.ModelSize(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                              intermediate_size=32, max_positions=256)
    return dataclasses.replace(
        cpu, name="tiny", dense=size,
        moe=dataclasses.replace(size, num_experts=4, experts_per_token=2),
        warmup=profiles.WarmupPlan(steps=3, batch_size=4, lr=1e-3, min_walk=1, max_walk=3),
        moe_warmup=profiles.WarmupPlan(steps=3, batch_size=4, lr=1e-3, min_walk=1, max_walk=3),
        task=profiles.TaskRange(min_walk=1, max_walk=4, eval_problems=8),
    )


@pytest.fixture
def lab_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


class WholeBook:
    """Every chapter executed by `python -m bookbuild.pipeline execute`, in a process group of its own.

    The session starts it once it knows a selected test needs it, and runs the tests that do last, so
    that the chapters execute while the quick tests run beside them. `after`: another execution
    this one waits for, so that no more than two chapters run at a time.
    """

    def __init__(self, args: list[str], env: dict | None = None, after: "WholeBook | None" = None):
        self.args, self.env, self.after = args, env or {}, after
        self.process = self.log = self.starter = None

    def start(self) -> None:
        SCRATCH.mkdir(exist_ok=True)

        def launch():
            if self.after is not None and self.after.starter is not None:
                self.after.starter.join()
                self.after.process.wait()
            with (SCRATCH / f"{self.args[1]}.log").open("w") as log:
                self.log = Path(log.name)
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "bookbuild.pipeline", "execute", *self.args], cwd=pipeline.ROOT,
                    env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        self.starter = threading.Thread(target=launch, daemon=True)
        self.starter.start()

    def failure(self) -> str:
        """What failed ("" when every chapter executed)."""
        if self.starter is None:
            self.start()
        self.starter.join()
        if self.process.wait():
            lines = self.log.read_text().splitlines()
            failed = [line for line in lines if line.startswith(pipeline.FAILED)]
            return (failed or lines[-20:] or [f"exited with {self.process.returncode}"])[-1]
        return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)


SCRATCH = Path(tempfile.gettempdir()) / f"precision-lab-tests-{os.getpid()}"  # logs and the gpu-paths build
BOOK = WholeBook(["--profile", "cpu", "--jobs", "2"])
BACKGROUND = {
    "book_executed": BOOK,
    # the gpu profile's code on the CPU (tests/test_gpu_paths.py): its numbers stay in the scratch folder
    "gpu_paths_build": WholeBook(["--profile", "gpu", "--jobs", "2", "--force", "--build", str(SCRATCH / "gpu-paths")],
                                 # a lab cache of its own, but the real model converted once, in the book's
                                 env={profiles.GPU_PATHS_ON_CPU: "1", "LAB_CACHE": str(SCRATCH / "gpu-paths" / "cache"),
                                      "LAB_PRETRAINED_CACHE": str(models.pretrained_root())},
                                 after=BOOK),
}


def pytest_collection_modifyitems(config, items):
    """Tests that wait for a whole-book execution run last, those that need only the book before those that
    need the gpu-paths run, so that the site and PDF build beside it (a stable sort keeps their order)."""
    items.sort(key=lambda item: [name in item.fixturenames for name in ("gpu_paths_build", "book_executed")])


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Start the executions the selected tests need (not for --collect-only or --setup-plan, nor in an xdist worker)."""
    option = session.config.option
    if option.collectonly or getattr(option, "setupplan", False) or hasattr(session.config, "workerinput"):
        return
    needed = {name for item in session.items for name in item.fixturenames} & BACKGROUND.keys()
    for name in ("book_executed", "gpu_paths_build"):  # the book first: the gpu-paths run waits for it
        if name in needed:
            BACKGROUND[name].start()


def pytest_sessionfinish(session):
    for book in BACKGROUND.values():
        book.stop()
    shutil.rmtree(SCRATCH, ignore_errors=True)


@pytest.fixture(scope="session")
def book_executed():
    """Every chapter executed in the cpu profile (unless unchanged), two at a time; what failed, or ""."""
    return BACKGROUND["book_executed"].failure()


@pytest.fixture(scope="session")
def gpu_paths_build():
    """Every chapter executed in the gpu profile's code paths on the CPU: (its build folder, what failed)."""
    return SCRATCH / "gpu-paths", BACKGROUND["gpu_paths_build"].failure()


@pytest.fixture(scope="session")
def built_book(book_executed):
    """The HTML book, built once per session from the chapters the session executed."""
    assert not book_executed, book_executed
    return pipeline.build_html()
