"""Wall time, throughput and peak memory of a block of code, labelled by how memory was read."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

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

    def rate(self, count: float) -> float:
        """`count` per second of wall time (iterations, tokens, ...)."""
        return count / self.seconds if self.seconds > 0 else float("nan")


@contextmanager
def measure(device: str = "cpu", sample_every: float = 0.005):
    """Time a block and record its peak memory: CUDA max allocated on GPU, sampled peak RSS on CPU."""
    result = Measurement()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield result
        torch.cuda.synchronize()
        result.seconds = time.perf_counter() - start
        result.peak_mem_mb = torch.cuda.max_memory_allocated() / 2**20
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
