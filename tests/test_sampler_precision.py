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
    with pytest.raises(ValueError, match="whole-engine dtype"):
        sampler_precision.parse("bf16", fp32_head=True)
    assert "emulated" in sampler_precision.parse("m3").label


@pytest.fixture
def lab(tiny_profile, lab_cache):
    return models.load(None, "dense", tiny_profile, seed=0)


def test_engine_weights_are_rounded_and_the_head_can_stay_fp32(lab):
    model, _ = lab
    coarse = sampler_precision.engine(model, "m3").model
    kept = sampler_precision.engine(model, "m3", fp32_head=True).model
    embed = model.get_input_embeddings().weight
    assert torch.equal(coarse.get_input_embeddings().weight, sampler_precision.round_mantissa(embed, 3))
    assert torch.equal(kept.get_output_embeddings().weight, embed)  # untied: the head keeps fp32
    assert torch.equal(kept.get_input_embeddings().weight, coarse.get_input_embeddings().weight)
    fp8_engine = sampler_precision.engine(model, "fp8").model
    q = fp8_engine.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, sampler_precision.fp8_cast(model.model.layers[0].self_attn.q_proj.weight, "tensor"))
    assert torch.equal(fp8_engine.get_output_embeddings().weight, embed)  # FP8 leaves the LM head alone


def test_sync_requantizes_the_new_weights(lab):
    model, _ = lab
    engine = sampler_precision.engine(model, "m4")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    engine.sync(model)
    for (name, ours), theirs in zip(engine.model.named_parameters(), model.parameters()):
        assert torch.equal(ours, sampler_precision.round_mantissa(theirs, 4)), name


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
    assert kl["m2"] > kl["m4"] > kl["m7"] > kl["m10"] > kl["fp32"]
