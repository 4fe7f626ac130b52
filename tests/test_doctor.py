"""The mismatch doctor: a bad request stops in one sentence before anything loads, and a run on the tiny
lab model writes its report and figure."""
import json

import pytest

from labutils import book_measurements, cross_engine, doctor, serving_options


def refusal(argv, **kwargs) -> str:
    """The sentence `doctor.main(argv)` exits with (a non-zero exit: SystemExit with a message)."""
    with pytest.raises(SystemExit) as stopped:
        doctor.main(argv, **kwargs)
    said = stopped.value.code
    assert isinstance(said, str) and said, f"exited with {said!r}, not a sentence"
    assert said.endswith(".") and said.count(". ") == 0, said
    return said


@pytest.mark.parametrize("argv, words", [
    (["--sampler", "llama.cpp:q5_k"], ["'q5_k'", "f32, f16, bf16, q8_0, q4_0"]),
    (["--trainer", "llama.cpp:f32"], ["does not train", "torch:fp32"]),
    (["--sampler", "llama.cpp:bf16", "--model", "lab:dense"], ["only for smollm2-135m-instruct",
                                                                "convert_hf_to_gguf.py"]),
    (["--sampler", "vllm:bf16"], ["'vllm'", "use torch or llama.cpp"]),
    (["--sampler", "bf16"], ["ENGINE:DTYPE"]),
    (["--sampler", "torch:int4"], ["not on the dial"]),
    (["--trainer", "torch:fp8"], ["fp32, bf16 or fp16"]),
    (["--tokens", "8"], ["at least 16"]),
    (["--sequences", "1"], ["at least 2"]),
    (["--temperature", "0"], ["must be positive"]),
    (["--model", "lab:giant"], ["lab:dense"]),
    (["--model", "./no/such/checkpoint"], ["does not exist"]),
    (["--sampler", "llama.cpp:bf16", "--top-p", "0.9"], ["--top-p", "torch sampler"]),
    (["--sampler", "llama.cpp:bf16", "--fp32-head", "both"], ["--fp32-head both", "torch sampler"]),
    (["--top-p", "0"], ["above 0"]),
    (["--flash-attention", "off"], ["llama.cpp's attention", "--sampler llama.cpp:bf16"]),
    (["--top-p", "0.9", "--logprobs", "raw"], ["truncated"]),
    (["--micro-batch", "0"], ["at least 1"]),
    (["--lora", "1.5"], ["[0, 1)"]),
])
def test_a_bad_request_stops_in_one_sentence(argv, words, tmp_path):
    said = refusal([*argv, "--json", str(tmp_path / "d.json")])
    for word in words:
        assert word in said, said
    assert not (tmp_path / "d.json").exists()


def test_a_missing_llama_cpp_build_is_refused(tmp_path, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else find(name, *a))
    said = refusal(["--sampler", "llama.cpp:bf16", "--json", str(tmp_path / "d.json")])
    assert "not installed" in said and "make setup" in said


def test_a_device_that_is_not_there_is_refused(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert "no CUDA GPU" in refusal(["--device", "cuda", "--json", str(tmp_path / "d.json")])


def test_a_length_past_the_context_and_too_much_memory_are_refused(tiny_profile, lab_cache, tmp_path):
    base = ["--model", "lab:dense", "--json", str(tmp_path / "d.json")]
    context = tiny_profile.dense.max_positions
    said = refusal([*base, "--tokens", str(context)], profile=tiny_profile)
    assert f"context of {context} tokens" in said and "--tokens" in said
    said = refusal([*base, "--tokens", "64", "--sequences", str(10 ** 9)], profile=tiny_profile)
    assert "lower --sequences" in said and "GB" in said


def test_a_run_on_the_tiny_model_writes_its_report_and_figure(tiny_profile, lab_cache, tmp_path, capsys):
    target = tmp_path / "doctor.json"
    found = doctor.main(["--model", "lab:dense", "--sampler", "torch:bf16", "--trainer", "torch:fp32",
                         "--tokens", "16", "--sequences", "3", "--json", str(target)], profile=tiny_profile)
    written = json.loads(target.read_text())
    assert (tmp_path / "doctor.png").stat().st_size > 0 and written["figure"] == str(tmp_path / "doctor.png")
    assert written["setup"]["prompts"] == "the toy task's prompts" and written["setup"]["tokens"] == 16
    kl = written["token_kl"]
    assert kl["value"] >= 0 and kl["sequences"] == 3 and kl["low"] <= kl["value"] <= kl["high"]
    assert [b["to"] for b in written["kl_by_band"]] == [4, 8, 12, 16]
    assert sum(b["count"] for b in written["kl_by_mu_bucket"]) == 3 * 16
    assert list(written["prefix_sd"]) == ["16"]
    assert set(written["frameworks"]) == {"trl", "verl", "NeMo-RL"}
    activations = written["activations"]  # chapter 8's probe: largest |value| per layer, fp16's headroom over it
    assert activations["measured"] and activations["residual"]["headroom"] * activations["residual"]["max"] == (
        pytest.approx(65504.0))
    assert len(activations["mlp_hidden"]["per_layer"]) == tiny_profile.dense.num_layers
    assert written["frameworks"]["verl"]["rollout_corr/k3_kl"] == pytest.approx(written["k3"]["value"], rel=1e-6)
    assert set(written["trl_modes"]) >= {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}
    assert all("no range" in v["line"] for v in written["verdicts"].values())  # the book measured another model
    printed = capsys.readouterr().out
    assert "token KL[μ‖π], exact" in printed and "wrote" in printed
    assert found["setup"]["sampler"] == "torch:bf16"


def test_the_pure_trainer_and_an_fp8_sampler_run_too(tiny_profile, lab_cache, tmp_path):
    found = doctor.main(["--model", "lab:dense", "--sampler", "torch:fp8", "--trainer", "torch:bf16",
                         "--trainer-mode", "pure", "--tokens", "16", "--sequences", "2",
                         "--json", str(tmp_path / "d.json"), "--figure", str(tmp_path / "f" / "fig.png")],
                        profile=tiny_profile)
    assert (tmp_path / "f" / "fig.png").is_file() and found["setup"]["trainer_mode"] == "pure"


def test_a_verdict_says_in_line_above_or_below_from_the_intervals_alone():
    book = [book_measurements.Reference(1e-3, 0.8e-3, 1.2e-3, "a", "cpu"),
            book_measurements.Reference(2e-3, 1.5e-3, 2.5e-3, "b", "cpu")]
    said = {value: book_measurements.verdict(value, 0.8 * value, 1.2 * value, book) for value in (2.2e-3, 6e-3, 2e-4)}
    assert said[2.2e-3].startswith("in line with the book's 0.001 – 0.002")
    assert said[6e-3].startswith("above the book's 0.001 – 0.002 (3× over it)")
    assert said[2e-4].startswith("below the book's 0.001 – 0.002 (5× under it)")
    assert "not measured" in book_measurements.verdict(1.0, 0.5, 1.5, [])


def test_the_books_measurements_are_read_from_its_cpu_build_and_committed_run(tmp_path, monkeypatch):
    from labutils import pretrained

    build = tmp_path / "results"
    build.mkdir()
    metrics = {"real.model": pretrained.DESCRIPTION, "real.sequences.bf16": 8, "real.tokens.bf16": 8 * 512,
               "real.exact_sequences.bf16": 4, "real.token_kl.bf16": 2e-3, "real.token_kl_stderr.bf16": 1e-4}
    env = {"cpu": "a CPU", "kernels": "its kernels"}
    (build / "04b_real_mismatch.json").write_text(json.dumps({"profile": "cpu", "env": env, "metrics": metrics}))
    committed = tmp_path / "real_rl.json"
    committed.write_text(json.dumps({"provenance": {"model": f"{pretrained.NAME}-0123"},
                                     "chosen": {"probe_sequences": 4, "max_new_tokens": 12},
                                     "runs": {"bf16_bf16": [{"probe_mismatch": [[2e-3, 4e-3, 3e-3, 3e-3]]}]}}))
    monkeypatch.setattr(book_measurements, "BUILD", build)
    monkeypatch.setattr(book_measurements, "COMMITTED_RL", committed)
    monkeypatch.setattr(cross_engine, "load", lambda plan=None: (None, "no committed run"))
    pure = book_measurements.references("token_kl", "bf16", "bf16", "pure")
    assert [r.value for r in pure] == [2e-3] and "4 chat requests × 512 tokens" in pure[0].where
    assert pure[0].device == "a CPU; its kernels"
    assert pure[0].low < 2e-3 - 2e-4  # a t interval over 4 sequences is wider than ± 2 standard errors
    assert [r.value for r in book_measurements.references("token_kl", "bf16", "bf16", "autocast")] == [3e-3]
    assert book_measurements.references("token_kl", "bf16", "fp16", "pure") == []
    (build / "04b_real_mismatch.json").write_text(json.dumps({"profile": "test", "metrics": metrics}))
    assert book_measurements.references("token_kl", "bf16", "bf16", "pure") == []  # a test build measures the toy


def test_the_progress_bar_leaves_the_models_output_alone(tiny_profile, lab_cache, tmp_path, monkeypatch):
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "update", lambda self, n=1: True)  # tqdm returns True whenever it redraws
    found = doctor.main(["--model", "lab:dense", "--tokens", "16", "--sequences", "2",
                         "--json", str(tmp_path / "d.json")], profile=tiny_profile)
    assert found["token_kl"]["sequences"] == 2


def test_the_cross_engine_run_gives_llama_cpps_references(monkeypatch):
    plan = {"tokens": 128, "block": 64}
    pair = {"kl_blocks": [[0.064, 0.064], [0.128, 0.128], [0.064, 0.128]],
            "log_ratio_blocks": [[-0.1, -0.1], [-0.2, -0.1], [0.0, -0.1]]}
    run = {"plan": plan, "pairs": {"llama.cpp:bf16|torch:fp32": pair},
           "provenance": {"cpu": "a CPU", "kernel_set": "its kernels"}}
    monkeypatch.setattr(cross_engine, "load", lambda plan=None: (run, None))
    found = book_measurements.references("token_kl", "llama.cpp:bf16", "fp32", "autocast")
    # per-sequence means 1e-3, 2e-3, 1.5e-3 nats per token: their mean, with a t interval over 3 sequences
    assert [r.value for r in found] == [pytest.approx(1.5e-3)] and "chapter 4c" in found[0].where
    assert found[0].low < 1.5e-3 < found[0].high
    assert book_measurements.references("token_kl", "llama.cpp:bf16", "bf16", "autocast") == []


def test_top_p_against_a_matching_trainer_is_its_closed_form(tiny_profile, lab_cache, tmp_path):
    found = doctor.main(["--model", "lab:dense", "--sampler", "torch:fp32", "--trainer", "torch:fp32",
                         "--top-p", "0.6", "--tokens", "16", "--sequences", "3", "--json", str(tmp_path / "d.json")],
                        profile=tiny_profile)
    closed = found["top_p"]["closed_form"]["value"]
    # where μ before the cut is π, KL[μ_p‖π] = −log(kept mass) exactly; fp32 engines agree far below 0.1%
    assert closed > 0.01 and found["token_kl"]["value"] == pytest.approx(closed, rel=1e-3)
    assert 0.6 <= found["top_p"]["kept_mass"] < 1


def test_raw_log_probabilities_undo_the_temperature_exactly():
    import torch

    logits = torch.randn(3, 50, dtype=torch.float64)
    processed = torch.log_softmax(logits / 0.7, dim=-1)
    assert torch.allclose(serving_options.raw_logprobs(processed, 0.7).double(), torch.log_softmax(logits, -1),
                          atol=1e-6)


def test_the_stack_options_run_on_the_tiny_model(tiny_profile, lab_cache, tmp_path, capsys):
    found = doctor.main(["--model", "lab:dense", "--sampler", "torch:bf16", "--trainer", "torch:bf16",
                         "--trainer-mode", "pure", "--fp32-head", "both", "--lora", "0.01", "--lora-rank", "4",
                         "--micro-batch", "1", "--temperature", "0.8", "--logprobs", "raw", "--tokens", "16",
                         "--sequences", "2", "--json", str(tmp_path / "d.json")], profile=tiny_profile)
    assert found["setup"]["lora"] == 0.01 and found["setup"]["micro_batch"] == 1
    assert len(found["per_sequence_kl"]) == 2 and found["token_kl"]["value"] > 0
    assert "fp32 LM head on both sides" in capsys.readouterr().out


def test_a_verdict_from_too_few_sequences_says_so_instead_of_in_line():
    book = [book_measurements.Reference(1e-3, 0.8e-3, 1.2e-3, "a", "cpu")]
    said = book_measurements.verdict(1e-3, -5e-3, 7e-3, book)
    assert said.startswith("too uncertain to compare") and "--sequences" in said
