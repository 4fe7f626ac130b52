import math

import pytest
import torch

from labutils import mismatch, models, rollout, sampler_precision, task


def _awkward_values(count: int = 200_000) -> torch.Tensor:
    """Random magnitudes over many binades, both signs, plus exact ties between neighbours."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(count, generator=g) * torch.exp2(torch.randint(-12, 12, (count,), generator=g).float())
    bf16_ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3 * 2**-9 + 2**-17])
    return torch.cat([values, bf16_ties, -values[:1000], torch.zeros(1)])


def test_eight_bit_mantissa_emulation_is_torchs_bf16_cast_bit_for_bit():
    x = _awkward_values()
    emulated = sampler_precision.round_mantissa(x, 7)
    assert torch.equal(emulated.view(torch.int32), x.to(torch.bfloat16).float().view(torch.int32))


def test_ten_bit_emulation_is_torchs_fp16_cast_in_fp16s_normal_range():
    x = _awkward_values()
    normal = (x.abs() >= torch.finfo(torch.float16).tiny) & (x.abs() <= 60000)
    x = torch.cat([x[normal], torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 2048 + 1.0])])  # ties to even
    assert torch.equal(sampler_precision.round_mantissa(x, 10), x.to(torch.float16).float())


def test_rounding_error_halves_with_each_mantissa_bit():
    x = _awkward_values()
    errors = [float(((sampler_precision.round_mantissa(x, m) - x) / x.masked_fill(x == 0, 1)).abs().max())
              for m in range(2, 11)]
    for m, err in zip(range(2, 11), errors):
        u = 2.0 ** -(m + 1)  # half an ulp at 1; relative to x the worst case is u / (1 + u), just above 1
        assert 0.99 * u / (1 + u) < err <= u / (1 + u) * (1 + 1e-6)


def test_fp8_cast_is_torchs_float8_cast_through_the_scale():
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(1)) * 3
    scale = w.abs().max() / 448
    assert torch.equal(sampler_precision.fp8_cast(w, "tensor"), (w / scale).to(torch.float8_e4m3fn).float() * scale)
    rows = w.abs().amax(-1, keepdim=True) / 448
    assert torch.equal(sampler_precision.fp8_cast(w, "channel"), (w / rows).to(torch.float8_e4m3fn).float() * rows)


def test_the_dial_refuses_settings_it_does_not_have():
    for bad in ("m1", "m11", "fp8_e5m2", "int8"):
        with pytest.raises(ValueError, match="not on the dial"):
            sampler_precision.parse(bad)
    assert "emulated" in sampler_precision.parse("m3").label


@pytest.fixture
def lab(tiny_profile, lab_cache):
    return models.load(None, "dense", tiny_profile, seed=0)


def test_the_emulation_rounds_linear_layers_only_and_fp8_runs_in_bf16_around_its_layers(lab):
    model, _ = lab
    embed = model.get_input_embeddings().weight
    q_weight = model.model.layers[0].self_attn.q_proj.weight
    coarse = sampler_precision.engine(model, "m3").model
    assert torch.equal(coarse.get_input_embeddings().weight, embed)  # the lookup stays fp32
    assert torch.equal(coarse.get_output_embeddings().weight, sampler_precision.round_mantissa(embed, 3))
    assert torch.equal(coarse.model.layers[0].self_attn.q_proj.weight, sampler_precision.round_mantissa(q_weight, 3))
    assert torch.equal(coarse.model.norm.weight, model.model.norm.weight)  # norm gains are not rounded
    fp8_engine = sampler_precision.engine(model, "fp8").model
    q = fp8_engine.model.layers[0].self_attn.q_proj
    assert q.weight.dtype == torch.float32  # FP8 values, fp32 accumulation
    assert torch.equal(q.weight, sampler_precision.fp8_cast(q_weight, "tensor"))
    assert fp8_engine.get_output_embeddings().weight.dtype == torch.bfloat16  # head, norms, stream: bf16
    assert fp8_engine.model.norm.weight.dtype == torch.bfloat16
    x = torch.randn(2, 3, q.in_features, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(sampler_precision.fp8_cast(x.float(), "tensor"), q.weight, q.bias)
    expected = expected.to(torch.bfloat16)
    assert torch.equal(q(x), expected)  # the layer's output returns to the bf16 stream


def test_sync_requantizes_the_new_weights(lab):
    model, _ = lab
    engine = sampler_precision.engine(model, "m4")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    engine.sync(model)
    linears = [name for name, module in engine.model.named_modules() if isinstance(module, torch.nn.Linear)]
    assert "lm_head" in linears
    for name in linears:
        theirs = model.get_submodule(name).weight
        assert torch.equal(engine.model.get_submodule(name).weight, sampler_precision.round_mantissa(theirs, 4)), name
    assert torch.equal(engine.model.get_input_embeddings().weight, model.get_input_embeddings().weight)


def test_mismatch_falls_as_mantissa_bits_rise(lab):
    model, tokenizer = lab
    prompts = [tokenizer(task.Problem(3, 7, 4).prompt, add_special_tokens=False)["input_ids"]] * 6
    scorer = rollout.TrainingEngine(model, torch.float32)
    kl = {}
    for name in ("m2", "m4", "m7", "m10", "fp32"):
        out = sampler_precision.engine(model, name).sample(prompts, 60, 60, keep_vocab=True,
                                                           generator=torch.Generator().manual_seed(0))
        scored = scorer.score(out, keep_vocab=True)
        kl[name] = mismatch.summary(out, scored.logprobs, scored.vocab)["token_kl"]
    # m = 10 sits at the floor two fp32 engines already give (summation order), so it is not ordered
    # against fp32; m = 7 lies above that floor
    assert kl["m2"] > kl["m4"] > kl["m7"] > 3 * max(kl["m10"], kl["fp32"])


def test_importance_health_on_a_known_batch():
    from labutils import grpo

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    log_ratio = torch.tensor([[0.5, -0.5, 0.0], [0.0, 0.0, 0.0]])
    health = grpo.importance_health(log_ratio, mask)
    tokens = torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0]).exp()
    assert health["token_weight_mean"] == pytest.approx(float(tokens.mean()))
    assert health["token_chi2"] == pytest.approx(float((tokens - 1).square().mean()))
    assert health["seq_weight_mean"] == pytest.approx(1.0) and health["seq_chi2"] == pytest.approx(0.0)
    assert health["ess"] == pytest.approx(1.0)
    skewed = grpo.importance_health(torch.tensor([[2.0], [0.0], [0.0], [0.0]]), torch.ones(4, 1))
    w = torch.tensor([2.0, 0, 0, 0]).exp()
    assert skewed["ess"] == pytest.approx(float(w.sum() ** 2 / (4 * w.square().sum())))


def test_corrected_fraction_counts_what_the_correction_changed():
    from labutils import grpo

    mask = torch.ones(2, 2)
    log_ratio = torch.log(torch.tensor([[3.0, 1.0], [0.5, 1.0]]))
    token = grpo.importance_weights(log_ratio, mask, "token_truncate", None, 2.0)
    assert grpo.corrected_fraction(log_ratio, mask, token, "token_truncate") == pytest.approx(0.25)
    sequence = grpo.importance_weights(log_ratio, mask, "sequence_mask", 0.6, 2.0)  # weights 3 and 0.5: both masked
    assert grpo.corrected_fraction(log_ratio, mask, sequence, "sequence_mask") == pytest.approx(1.0)
    kept = grpo.importance_weights(log_ratio, mask, "sequence_mask", 0.4, 4.0)
    assert grpo.corrected_fraction(log_ratio, mask, kept, "sequence_mask") == 0.0


def _figures(scores, start=0.8):
    from labutils import rl_analysis

    curves = [{"reward": [0.5], "eval": [start, f, f, f], "eval_steps": [0, 1, 2, 3], "kl": [0.0] * 3,
               "grad_norm": [1.0], "ess": [1.0], "seq_chi2": [0.0], "corrected": [], "eval_problems": 256}
              for f in scores]
    return rl_analysis.summarize(curves, margin=0.15)


def test_a_comparison_is_a_difference_no_difference_with_power_or_inconclusive():
    from labutils import rl_analysis

    collapsing, steady = _figures([0.2, 0.3, 0.25, 0.2]), _figures([0.85, 0.8, 0.9, 0.85])
    assert collapsing["collapsed_seeds"] == 4 and steady["collapsed_seeds"] == 0
    assert rl_analysis.conclusion(*rl_analysis.compare(collapsing, steady), 0.05, 3)[0] == rl_analysis.DIFFERENCE
    tight = _figures([0.851, 0.801, 0.899, 0.851] * 4), _figures([0.85, 0.8, 0.9, 0.85] * 4)
    gap, noise = rl_analysis.compare(*tight)
    assert rl_analysis.conclusion(gap, noise, 0.05, 15)[0] == rl_analysis.NO_DIFFERENCE
    noisy = _figures([0.9, 0.1, 0.8, 0.2])
    gap, noise = rl_analysis.compare(noisy, steady)
    assert rl_analysis.conclusion(gap, noise, 0.05, 3)[0] == rl_analysis.INCONCLUSIVE
    assert rl_analysis.sentence(gap, noise, 0.05, 4).startswith("inconclusive: ") and "power" in \
        rl_analysis.sentence(gap, noise, 0.05, 4)


def test_seed_noise_uses_the_t_quantile_and_the_evaluations_binomial_floor():
    from labutils import rl_analysis

    gap, noise = rl_analysis.compare(_figures([0.5, 0.6]), _figures([0.6, 0.7]))  # two seeds, identical shift
    assert gap == pytest.approx(0.1)
    floor = ((0.55 * 0.45 + 0.65 * 0.35) / (3 * 256) / 2) ** 0.5  # a score averages three evaluations
    assert noise == pytest.approx(12.706 * floor, rel=1e-3)  # t(0.975, 1 df) times the binomial floor
    assert rl_analysis.compare(_figures([0.5]), _figures([0.9]))[1] == float("inf")


def test_gradient_agreement_and_its_jackknife_error():
    from labutils import mismatch_rl

    reference = torch.tensor([1.0, 0.0])
    same = mismatch_rl.agreement(torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]), reference)
    assert same["cosine"] == pytest.approx(1.0) and same["cosine_stderr"] == pytest.approx(0.0, abs=1e-12)
    spread = mismatch_rl.agreement(torch.tensor([[1.0, 1.0], [1.0, -1.0], [1.0, 0.5]]), reference)
    assert spread["cosine_stderr"] > 0 and spread["relative_difference"] == pytest.approx(0.5 / 3)


def test_paired_bias_is_zero_for_identical_samplers_and_finds_a_planted_shift():
    from labutils import mismatch_rl

    g = torch.Generator().manual_seed(0)
    signal = torch.tensor([1.0, 0.0, 0.0, 0.0])
    baseline = signal + 0.3 * torch.randn(40, 4, generator=g)
    same = mismatch_rl.paired_bias(baseline.clone(), baseline)
    assert same["relative_bias_sq"] == pytest.approx(0.0, abs=1e-12)
    noisy = baseline + 0.3 * torch.randn(40, 4, generator=g)  # noise only: the estimate is near zero
    unbiased = mismatch_rl.paired_bias(noisy, baseline)
    assert abs(unbiased["relative_bias_sq"]) < 3 * unbiased["relative_bias_sq_stderr"]
    shifted = mismatch_rl.paired_bias(noisy + torch.tensor([0.0, 0.5, 0.0, 0.0]), baseline)
    assert shifted["relative_bias_sq"] == pytest.approx(0.25, abs=4 * shifted["relative_bias_sq_stderr"])
    assert shifted["relative_bias_sq"] > 3 * shifted["relative_bias_sq_stderr"]
    pure_noise = 0.3 * torch.randn(4, 4, generator=g)  # π's gradient itself unresolved: no ratio, no division by ~0
    assert math.isnan(mismatch_rl.paired_bias(pure_noise + 0.1, pure_noise)["relative_bias_sq"])


def test_sweeps_run_in_a_serial_pool_on_the_lab_model(tiny_profile, lab_cache):
    from labutils import mismatch_rl

    pool = mismatch_rl.workers(1)
    model, tokenizer = models.load(None, "dense", tiny_profile, seed=0)
    prompts = [tokenizer(task.Problem(3, 7, 2).prompt, add_special_tokens=False)["input_ids"]] * 2
    dial = mismatch_rl.dial_sweep(tiny_profile, ["m2", "fp32"], prompts, 20, 0, 10, pool)
    assert dial["m2"]["token_kl"] > dial["fp32"]["token_kl"] and dial["m2"]["tokens"] == 40
    rows = mismatch_rl.gradients(tiny_profile, [("fp32", 1), ("m2", 1)], prompts, ["3", "3"], 2, 3, 12, pool)
    parameters = sum(p.numel() for p in model.parameters())
    assert [r.shape for r in rows] == [(3, parameters)] * 2


def test_the_fork_servers_preload_imports():
    """multiprocessing's fork server passes over a preload that fails to import: the pool would quietly lose it."""
    import gc
    import importlib

    importlib.import_module("labutils.run_imports")
    gc.unfreeze()  # it freezes the process that imports it, which is meant to be the fork server
