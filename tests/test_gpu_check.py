"""`make wheels` and `make gpu-check`'s install path, checked where there is no GPU."""
import dataclasses
import subprocess
import sys

import pytest

from labutils import models, profiles
from bookbuild import gpu_check, pipeline, wheels


@pytest.fixture(scope="module")
def wheel_folder():
    folder = models.cache_root().parent / "wheels-3.12"  # kept between runs: pip skips wheels already there
    try:
        wheels.download(folder, "3.12")
    except subprocess.CalledProcessError as err:
        pytest.skip(f"the package registry cannot be reached: {err}")
    return folder


def test_the_wheel_folder_installs_into_a_clean_target_without_an_index(wheel_folder, tmp_path):
    found = sorted(wheel_folder.glob("*.whl"))
    assert sum(w.stat().st_size for w in found) < wheels.LIMIT_MB * 2**20
    platforms = [arg for p in wheels.PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "--target", str(tmp_path),
                    *map(str, found)], check=True)
    installed = {wheels.canonical(p.name.split("-")[0]) for p in tmp_path.glob("*.dist-info")}
    assert {wheels.canonical(r) for r in wheels.ROOTS} <= installed
    assert not any(wheels.PROVIDED.match(name) for name in installed)  # the GPU machine's torch stack stays its own


def test_install_takes_the_measured_libraries_and_refuses_a_machine_without_cuda(wheel_folder, tmp_path):
    with pytest.raises(SystemExit, match="a CUDA device"):
        gpu_check.install(wheel_folder, str(tmp_path))
    taken = {wheels.canonical(p.name.split("-")[0]) for p in tmp_path.glob("*.dist-info")}
    assert set(wheels.MATCH) <= taken  # always the versions the book was measured with


def test_install_says_where_the_wheels_come_from(tmp_path):
    with pytest.raises(SystemExit, match="make wheels"):
        gpu_check.install(tmp_path / "none", str(tmp_path / "site"))


def test_run_refuses_a_machine_without_cuda():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gpu_check.run(["01_number_formats"], budget=10)


def test_the_trimmed_profile_keeps_the_gpu_sizes_and_does_less():
    gpu = profiles.PROFILES["gpu"]
    trimmed = profiles.gpu_trimmed(gpu)
    assert (trimmed.dense, trimmed.moe, trimmed.device) == (gpu.dense, gpu.moe, "cuda")
    assert trimmed.rl.steps < gpu.rl.steps and trimmed.mismatch.sequences < gpu.mismatch.sequences
    for stem in pipeline.chapters():
        assert gpu_check._scale(stem, gpu, trimmed) >= 1.0
    assert gpu_check._scale("05_grpo_precision", gpu, trimmed) == gpu.rl.steps / trimmed.rl.steps
    shrunk = dataclasses.replace(trimmed, rl=dataclasses.replace(trimmed.rl, steps=gpu.rl.steps))
    assert gpu_check._scale("05_grpo_precision", gpu, shrunk) == 1.0


def test_a_chapter_executes_the_way_gpu_check_runs_it(tmp_path, monkeypatch):
    monkeypatch.setenv(profiles.GPU_PATHS_ON_CPU, "1")  # the gpu profile, on this CPU
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path / "results"))
    seconds, problem = gpu_check._execute("01_number_formats", tmp_path, timeout=300)
    assert problem == "" and seconds > 0
    assert (tmp_path / "results" / "01_number_formats.json").is_file()
    seconds, problem = gpu_check._execute("01_number_formats", tmp_path, timeout=1)
    assert problem == "stopped after 1 s"


def test_the_engines_agree_with_the_cache_used_and_not_without_it(monkeypatch):
    from labutils import rollout

    assert gpu_check.engines_agree("cpu") < 1e-5
    monkeypatch.setattr(rollout, "cache_keyword", lambda model: "not_a_cache")  # as a transformers that renamed it
    assert gpu_check.engines_agree("cpu") > 1e-3
