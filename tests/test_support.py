"""profiles, results, measure, plots, env."""
import json
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from labutils import env_report, measure, plots, profiles, results


def test_profiles_resolve_and_reject():
    assert profiles.resolve("cpu").name == "cpu"
    assert profiles.resolve("auto").name in ("cpu", "gpu")
    with pytest.raises(ValueError, match="choose one of 'auto', 'cpu', 'gpu'"):
        profiles.resolve("tpu")
    assert profiles.resolve("cpu").device == "cpu" and profiles.PROFILES["gpu"].device == "cuda"


@pytest.mark.parametrize("capability, name, native", [
    ((7, 5), "Tesla T4", False), ((7, 0), "Tesla V100", False), ((8, 9), "NVIDIA L4", True), ((9, 0), "NVIDIA H100", True),
])
def test_auto_picks_the_gpu_everywhere_and_says_where_bf16_is_emulated(monkeypatch, capsys, capability, name, native):
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(total_memory=80 * 2**30, name=name))
    chosen = profiles.check_parameters("auto", 0, bf16_parts="the bf16 engines")
    assert (chosen.name, chosen.device, chosen.bf16_native) == ("gpu", "cuda", native)
    said = capsys.readouterr().out
    assert ("the bf16 engines run on it without bf16 tensor cores" in said) == (not native)
    assert (f"{name} (compute capability {capability[0]}.{capability[1]}) has no bf16 arithmetic" in said) == (not native)


def test_gpu_profile_without_cuda_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="profile='gpu' needs a CUDA GPU"):
        profiles.resolve("gpu")
    assert profiles.resolve("auto").name == "cpu"


@pytest.mark.parametrize("gib, capability, trimmed", [(15, (7, 5), True), (22, (8, 9), True), (40, (8, 0), True),
                                                   (79, (9, 0), False), (139, (9, 0), False)])
def test_auto_takes_the_trimmed_gpu_sizes_on_a_card_smaller_than_the_gpu_profile_was_sized_for(
        monkeypatch, gib, capability, trimmed):
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: types.SimpleNamespace(total_memory=gib * 2**30, name="a GPU"))
    monkeypatch.setenv(profiles.GPU_TRIMMED, "0")  # auto sets it on a small card; restored afterwards
    gpu = profiles.PROFILES["gpu"]
    auto = profiles.resolve("auto")
    expected = profiles.gpu_trimmed(gpu) if trimmed else gpu
    assert auto.name == "gpu" and auto.mismatch.sequences == expected.mismatch.sequences
    assert auto.real.length == expected.real.length and auto.bf16_native == (capability >= (8, 0))
    # a process the chapter starts resolves "gpu" and takes the same sizes
    assert profiles.resolve("gpu").mismatch.sequences == expected.mismatch.sequences
    monkeypatch.setenv(profiles.GPU_TRIMMED, "0")
    assert profiles.resolve("gpu").mismatch.sequences == gpu.mismatch.sequences  # by name alone: full sizes


@pytest.mark.parametrize("kwargs, message", [
    ({"seed": -1}, "seed=-1"), ({"seed": "0"}, "seed='0'"), ({"seed": 0, "model_id": ""}, "model_id"),
    ({"seed": 0, "steps": 0}, "steps=0"),
])
def test_bad_parameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        profiles.check_parameters("cpu", **kwargs)


def test_every_profile_is_complete():
    for p in profiles.PROFILES.values():
        assert p.warmup.steps > 0 and p.task.max_walk > p.warmup.max_walk


def test_flatten_makes_dotted_keys():
    import torch

    flat = results.flatten({"a": {"b": 1, "c": {"d": torch.tensor(2.5)}}, "e": float("nan")})
    assert flat == {"a.b": 1, "a.c.d": 2.5, "e": "nan"}


def test_chapter_run_writes_the_contract(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path))
    run = results.ChapterRun("99_demo", "cpu")
    run.record(eps={"float16": 2**-10}, flag=True)
    path = run.save()
    data = json.loads(path.read_text())
    assert set(data) == {"chapter", "profile", "seconds", "env", "metrics"}
    assert data["metrics"] == {"eps.float16": 2**-10, "flag": True}
    assert set(data["env"]) == {"python", "torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate",
                                "gguf", "device", "device_name", "cuda", "cpu", "kernels"}
    assert data["env"]["kernels"].startswith("aten ")  # the CPU's kernel set: another draws other numbers
    assert results.load("99_demo", tmp_path) == data
    assert [p.name for p in tmp_path.iterdir()] == ["99_demo.json"]  # no temporary left behind


def test_measure_times_and_reads_memory():
    with measure.measure("cpu") as m:
        blob = bytearray(64 * 2**20)
        time.sleep(0.05)
    assert m.seconds >= 0.05 and m.peak_mem_mb > 64 and m.mem_label.startswith("CPU")
    assert m.rate(10) == pytest.approx(10 / m.seconds)
    del blob


def test_rss_and_the_kernels_peak_see_an_allocation():
    import mmap

    before, peak_before = measure.rss_mb(), measure.process_peak_rss_mb()
    # an anonymous mapping: fresh pages, where a bytearray may reuse heap that earlier tests freed but kept resident
    blob = mmap.mmap(-1, 96 * 2**20)
    blob[:: 4096] = b"x" * len(blob[:: 4096])  # touch every page so it is resident
    assert measure.rss_mb() > before + 80
    assert measure.process_peak_rss_mb() >= max(peak_before, measure.rss_mb() - 1)
    blob.close()


def test_forked_runs_return_each_jobs_result_and_a_fresh_peak():
    blob = bytearray(256 * 2**20)
    blob[:: 4096] = b"x" * len(blob[:: 4096])
    # the forked process comes from one that imported the library but never held this allocation: its peak is its own
    assert measure.forked_runs("labutils.measure:process_peak_rss_mb", [{}])[0] < measure.process_peak_rss_mb() - 200
    del blob
    assert measure.forked_runs("json:dumps", [{"obj": [1, 2]}, {"obj": {"a": 3}}]) == ["[1, 2]", '{"a": 3}']
    for fork in (True, False):  # forked from one runner, or (where CUDA is visible) a fresh interpreter each
        pids = measure.forked_runs("os:getpid", [{}, {}], fork=fork)
        assert len(set(pids)) == 2 and os.getpid() not in pids  # a process of its own per job
        with pytest.raises(RuntimeError, match="failed in its own process"):
            measure.forked_runs("json:loads", [{"s": "not json"}], fork=fork)


def test_forked_runs_stop_a_job_that_runs_too_long():
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="ran past 2 s"):
        measure.forked_runs("subprocess:call", [{"args": ["sleep", "60"]}], timeout=2)
    assert time.perf_counter() - start < 30


def test_plots_save_next_to_results(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path))
    plots.style()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    assert plots.save(fig, "99_demo", "line") == tmp_path / "figures" / "99_demo-line.png"
    assert (tmp_path / "figures" / "99_demo-line.png").stat().st_size > 0


def test_env_report_names_the_device():
    report = env_report()
    assert report["device"] in ("cpu", "cuda") and report["torch"][0].isdigit()


def test_metrics_table():
    table = results.metrics_table({"a": 0.5, "b": True, "c": 2}, keys=["b", "a"], notes={"b": "False (source)"})
    assert list(table.data.columns) == ["metric", "this run", "the sources say"]
    assert table.data.values.tolist() == [["b", True, "False (source)"], ["a", 0.5, ""]]
    assert results.metrics_table({"a": 1}).data.values.tolist() == [["a", 1]]


def test_half_ulp_and_lost_updates_follow_the_dtype_spacing():
    import torch

    from labutils import updates

    one = torch.tensor([1.0])
    assert float(updates.half_ulp(one.to(torch.bfloat16))) == 2**-8
    assert float(updates.half_ulp(one.to(torch.float16))) == 2**-11
    # an update of 1e-3 on a weight of 1.0: lost in bf16 (half-ulp 2^-8 ~ 3.9e-3), kept in fp16
    assert updates.predicted_loss(one, torch.tensor([1.0]), [1e-3], torch.bfloat16) == [1.0]
    assert updates.predicted_loss(one, torch.tensor([1.0]), [1e-3], torch.float16) == [0.0]
    w = torch.tensor([1.0], dtype=torch.bfloat16)
    assert torch.equal(w + torch.tensor([1e-3], dtype=torch.bfloat16), w)  # the rule, checked against torch


def test_importance_weights_in_all_four_of_trls_modes():
    import pytest
    import torch

    from labutils import grpo

    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    log_ratio = torch.log(torch.tensor([[3.0, 0.25], [1.5, 1.0]])) * mask
    token_truncate = grpo.importance_weights(log_ratio, mask, "token_truncate", 0.5, 2.0)
    assert torch.allclose(token_truncate, torch.tensor([[2.0, 0.5], [1.5, 0.0]]))
    token_mask = grpo.importance_weights(log_ratio, mask, "token_mask", 0.5, 2.0)
    assert torch.allclose(token_mask, torch.tensor([[0.0, 0.0], [1.5, 0.0]]))
    sequence_truncate = grpo.importance_weights(log_ratio, mask, "sequence_truncate", None, 0.5)  # 0.75 and 1.5
    assert torch.allclose(sequence_truncate, torch.tensor([[0.5, 0.5], [0.5, 0.0]]))
    sequence_mask = grpo.importance_weights(log_ratio, mask, "sequence_mask", 1.0, 2.0)
    assert torch.allclose(sequence_mask, torch.tensor([[0.0, 0.0], [1.5, 0.0]]))
    with pytest.raises(ValueError, match="not one of trl's"):
        grpo.importance_weights(log_ratio, mask, "token_clip", None, 2.0)


def test_provenance_and_gpu_reference_read_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path / "_build" / "results"))
    run = results.ChapterRun("99_demo", "cpu")
    run.save()
    text = results.provenance("99_demo").data
    assert "`cpu` profile on cpu" in text and "_build/results/99_demo.json" in text
    assert "kernels aten" in text  # the CPU kernel set that drew these numbers
    (tmp_path / "_toc.yml").write_text("root: intro\n")
    monkeypatch.chdir(tmp_path)
    assert results.gpu_reference("99_demo") is None
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "gpu" / "99_demo.json").write_text(json.dumps({"chapter": "99_demo", "profile": "gpu"}))
    assert results.gpu_reference("99_demo")["profile"] == "gpu"


def test_launch_refuses_a_batch_that_does_not_split(monkeypatch, tmp_path):
    import pytest

    from labutils import launch

    monkeypatch.setenv("WORLD_SIZE", "3")  # 16 completions per step over 3 processes
    with pytest.raises(ValueError, match="does not split over 3 processes"):
        launch.main(["--profile", "cpu", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="not a profile"):
        launch.main(["--profile", "tpu", "--out", str(tmp_path)])


def test_a_committed_gpu_run_shows_beside_this_run(tmp_path, monkeypatch):
    import json

    from labutils import results

    (tmp_path / "_toc.yml").write_text("root: intro\n")
    monkeypatch.chdir(tmp_path)
    assert "GPU" not in results.metrics_table({"a": 1.0}, chapter="zz").to_html()  # nothing committed: no column
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "gpu" / "zz.json").write_text(json.dumps(
        {"chapter": "zz", "env": {"device_name": "NVIDIA H200"}, "metrics": {"a": 2.5},
         "provenance": {"gpu": "NVIDIA H200", "cuda": "13.0", "date": "2026-12-01T00:00:00", "trimmed": True}}))
    shown = results.metrics_table({"a": 1.0, "b": 2}, chapter="zz").to_html()
    assert "GPU: NVIDIA H200" in shown and "2.5" in shown and "trimmed" in shown
