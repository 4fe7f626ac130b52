"""The gpu profile's code, executed on the CPU: a shape, config or API error in it fails here, not on a reader's GPU.

Every chapter runs through the pipeline in the gpu profile's layer shapes, group sizes, LoRA ranks and
plans, with depth, steps, counts and lengths at a minimum (`profiles.gpu_paths_on_cpu`, switched on by
LAB_GPU_PATHS_ON_CPU: a test mode, not a profile readers see). Its numbers mean nothing and stay in
a temporary folder. What only a CUDA device runs is the list below, checked against the chapters.
"""
import dataclasses
import json
import re

import pytest

from labutils import profiles
from bookbuild import pipeline

# Lines that branch on CUDA: only a GPU executes their CUDA side (everything else runs here).
CUDA_ONLY = {
    ("02_qlora_crash", 'crash_dtype = torch.float16 if DEVICE == "cuda" else torch.float32  # the 4-bit compute dtype'),
    ("02_qlora_crash", 'for device in ["cpu"] + (["cuda"] if DEVICE == "cuda" else []):'),
    ("02_qlora_crash", '"fp16_fp32_trainables": dict(compute_dtype="float16" if DEVICE == "cuda" else "float32",'),
    ("02_qlora_crash", 'if DEVICE == "cuda":  # what the caching allocator held, beside what tensors used'),
    ("09_fp8", 'capability = torch.cuda.get_device_capability() if DEVICE == "cuda" else None'),
    ("09_fp8", 'if DEVICE == "cuda":'),
    ("09_fp8", 'run.record(matmul={"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",'),
    ("11_troubleshooting", 'old_gpu = DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 0)'),
    ("02_qlora_crash", 'timeout=1800.0 * (len(jobs) if DEVICE == "cuda" else 1))'),  # a cap per job on a GPU
    ("04b_real_mismatch", '+ ("" if DEVICE == "cuda" else ", unused on a CPU")),'),  # the cuBLAS library's name
    ("04b_real_mismatch", 'if DEVICE == "cuda" else'),  # the speed reading on a GPU
}
# ... and in labutils: what runs only where the device is CUDA (the CPU takes the other side of each)
CUDA_ONLY_HELPERS = {
    ("env.py", "if torch.cuda.is_available():"),  # the GPU's name and CUDA version in env_report
    ("grpo.py", 'if device != "cuda" or train_dtype == torch.float32:'),  # accelerate's fp16/bf16 flags, its scaler
    ("measure.py", 'if device.startswith("cuda"):'),  # max_memory_allocated and reserved
    ("rollout.py", 'if kind == "cuda":'),  # engine_dtype's CUDA checks
    ("pretrained.py", 'if profile.device != "cuda":'),  # a GPU without the real model's wheel measures the toy
    ("launch.py", 'if profile.device != "cuda" or processes <= 1:'),  # one GPU per DDP process (tested below)
    ("gpu_memory.py", 'if profile.device == "cuda":'),  # the chapter's peak against the free memory (test_gpu_check)
}
BRANCH = re.compile(r'DEVICE == "cuda"|P\.device == "cuda"')
HELPER_BRANCH = re.compile(r'^\s*if (.*(== "cuda"|!= "cuda"|startswith\("cuda"\)).*|torch\.cuda\.is_available\(\)):$')
NOT_RUN_BY_CHAPTERS = {"gpu_check.py", "profiles.py", "preflight.py", "status.py", "doctor.py"}  # tested on their own


def test_the_cuda_only_lines_are_the_listed_ones():
    found = set()
    for stem in pipeline.chapters():
        for line in (pipeline.ROOT / "chapters" / f"{stem}.md").read_text().splitlines():
            if BRANCH.search(line):
                found.add((stem, line.strip()))
    assert found == CUDA_ONLY, "a chapter branches on CUDA in a new place: list it in CUDA_ONLY, or run it here"
    helpers = {(module.name, line.strip()) for module in sorted((pipeline.ROOT / "labutils").glob("*.py"))
               if module.name not in NOT_RUN_BY_CHAPTERS
               for line in module.read_text().splitlines() if HELPER_BRANCH.search(line)}
    assert helpers == CUDA_ONLY_HELPERS, "labutils branches on CUDA in a new place: list it, or run it here"


def test_the_test_mode_keeps_the_gpu_sizes_on_the_cpu(monkeypatch):
    monkeypatch.setenv(profiles.GPU_PATHS_ON_CPU, "1")
    paths, gpu = profiles.resolve("gpu"), profiles.PROFILES["gpu"]
    assert (paths.name, paths.device) == ("gpu", "cpu")
    assert (paths.grpo.lora_rank, paths.grpo.num_generations) == (gpu.grpo.lora_rank, gpu.grpo.num_generations)
    for size, full in ((paths.dense, gpu.dense), (paths.moe, gpu.moe)):  # every layer's shape, fewer layers
        assert dataclasses.replace(size, num_layers=full.num_layers) == full and size.num_layers < full.num_layers
    assert paths.warmup.steps < gpu.warmup.steps and paths.rl.steps < gpu.rl.steps
    monkeypatch.delenv(profiles.GPU_PATHS_ON_CPU)
    assert "paths" not in profiles.VALID_PROFILES  # not a profile a reader can pick


@pytest.mark.chapter
@pytest.mark.parametrize("stem", pipeline.chapters())
def test_every_chapter_runs_its_gpu_profile_code(gpu_paths_build, stem):
    build, failure = gpu_paths_build
    assert stem not in failure, f"{stem} failed in the gpu profile's code paths: {failure}"
    data = json.loads((build / "results" / f"{stem}.json").read_text())
    assert data["profile"] == "gpu" and data["env"]["device"] == "cpu"


def test_a_two_process_launch_is_refused_where_one_gpu_would_hold_both(monkeypatch):
    import torch

    from labutils import launch

    gpu = profiles.PROFILES["gpu"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launch.refusal(gpu, 1) is None  # one process, one GPU
    reason = launch.refusal(gpu, 2)
    assert reason.startswith("a DDP run on 2 processes needs 2 GPUs and this machine has 1") and reason.count(". ") == 0
    with pytest.raises(RuntimeError, match="NCCL refuses two processes on one GPU"):
        launch.require(gpu, 2)  # before launch(1) trains a step
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch.refusal(gpu, 2) is None
    assert launch.refusal(profiles.PROFILES["cpu"], 2) is None  # gloo: the processes share the cores
