"""Wall time, throughput and peak memory of a block of code, labelled by how memory was read."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_PAGE = 4096


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * _PAGE


@dataclass
class Measurement:
    """What one measured block cost."""

    seconds: float = 0.0
    peak_mem_mb: float = 0.0
    mem_label: str = ""
    peak_reserved_mb: float = float("nan")  # CUDA only: what the caching allocator held from the driver

    def rate(self, count: float) -> float:
        """`count` per second of wall time (iterations, tokens, ...)."""
        return count / self.seconds if self.seconds > 0 else float("nan")


@contextmanager
def measure(device: str = "cpu", sample_every: float = 0.005):
    """Time a block and record its peak memory: CUDA max allocated on GPU, sampled peak RSS on CPU."""
    result = Measurement()
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield result
        torch.cuda.synchronize()
        result.seconds = time.perf_counter() - start
        result.peak_mem_mb = torch.cuda.max_memory_allocated() / 2**20
        result.peak_reserved_mb = torch.cuda.max_memory_reserved() / 2**20
        result.mem_label = "CUDA max allocated"
        return
    peak = [_rss_bytes()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(sample_every):
            peak[0] = max(peak[0], _rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        yield result
    finally:
        result.seconds = time.perf_counter() - start
        done.set()
        sampler.join()
        result.peak_mem_mb = max(peak[0], _rss_bytes()) / 2**20
        result.mem_label = "CPU peak RSS (process)"


def rss_mb() -> float:
    """This process's resident set size now, in MiB."""
    return _rss_bytes() / 2**20


def process_peak_rss_mb() -> float:
    """The kernel's high-water mark of this process's resident set (VmHWM), in MiB: exact, not sampled.

    Not `getrusage().ru_maxrss`: Linux carries that across exec, so a process started from a large
    parent would report the parent's peak.
    """
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # the kernel reports kB
    raise OSError("/proc/self/status has no VmHWM line; peak RSS is readable on Linux only.")


def forked_runs(target: str, jobs: list[dict], preload: tuple[str, ...] = (), fork: bool | None = None,
                timeout: float = 1800.0) -> list[dict]:
    """`module:function(**job)` for each job, each in a process of its own; their JSON-able results, in order.

    One fresh Python process imports `preload` and the target's module, runs nothing else, and forks
    one child per job, one after the other: the imports are paid once instead of per job. A child's
    peak resident set (VmHWM, which Linux resets at fork) counts the memory it allocates, the
    parent's pages it was forked with, and the library pages it touches itself; nothing any other job
    allocated. Where a CUDA device is visible (`fork=None`), or with `fork=False`, every job gets a
    fresh interpreter instead: importing bitsandbytes initialises the CUDA driver, which a forked
    child cannot use. The whole process group is killed after `timeout` seconds.
    """
    import signal

    if fork is None:
        import torch

        fork = not torch.cuda.is_available()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as folder:
        spec = Path(folder) / "jobs.json"
        spec.write_text(json.dumps({"target": target, "jobs": jobs, "preload": list(preload), "fork": fork}))
        runner = subprocess.Popen([sys.executable, "-c", "import sys; from labutils.measure import _fork_each; "
                                   "_fork_each(sys.argv[1])", folder], cwd=root, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, stderr = runner.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(runner.pid, signal.SIGKILL)  # the runner and whichever job it is waiting for
            runner.communicate()
            raise RuntimeError(f"{target} ran past {timeout:.0f} s in its own process and was stopped.") from None
        if runner.returncode != 0:
            raise RuntimeError(f"{target} failed in its own process (exit {runner.returncode}):\n{stderr[-3000:]}")
        return [json.loads((Path(folder) / f"{i}.json").read_text()) for i in range(len(jobs))]


def _fork_each(folder: str) -> None:
    """The runner of `forked_runs`: import, then fork (or start a fresh interpreter) and wait, one job at a time."""
    import importlib
    import traceback

    spec = json.loads((Path(folder) / "jobs.json").read_text())
    if not spec["fork"]:
        for i in range(len(spec["jobs"])):
            subprocess.run([sys.executable, "-c", "import sys; from labutils.measure import _one_job; "
                            "_one_job(sys.argv[1], int(sys.argv[2]))", folder, str(i)], check=True)
        return
    # jobs with modules to preload use torch (a plain function, as in the tests, does not need it): one thread
    # before anything runs, so no OpenMP thread team exists at the fork and a child can start its own
    torch = importlib.import_module("torch") if spec["preload"] else None
    if torch:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    for name in spec["preload"]:
        importlib.import_module(name)
    module, name = spec["target"].split(":")
    function = getattr(importlib.import_module(module), name)
    for i, job in enumerate(spec["jobs"]):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                if torch:
                    torch.set_num_threads(threads)
                (Path(folder) / f"{i}.json").write_text(json.dumps(function(**job)))
            except BaseException:  # the child must never return into the runner's loop
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"job {i} of {spec['target']} failed (exit status {os.waitstatus_to_exitcode(status)}).")


def _one_job(folder: str, i: int) -> None:
    """Job `i` of a `forked_runs` folder, in this (fresh) interpreter."""
    import importlib

    spec = json.loads((Path(folder) / "jobs.json").read_text())
    module, name = spec["target"].split(":")
    result = getattr(importlib.import_module(module), name)(**spec["jobs"][i])
    (Path(folder) / f"{i}.json").write_text(json.dumps(result))
