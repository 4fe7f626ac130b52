"""labutils.lora_serving, overflow and clipping at tiny sizes."""
import copy

import pytest
import torch

from labutils import clipping, lora_serving, mismatch, models, overflow, rollout, task


@pytest.fixture
def lab(tiny_profile, lab_cache):
    return models.load(None, "dense", tiny_profile, seed=0)


def _prompts(tokenizer, walks):
    return [tokenizer(task.Problem(3, 7, n).prompt, add_special_tokens=False)["input_ids"] for n in walks]


def _lora(model, b_std):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"],
                        task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, config)
    g = torch.Generator().manual_seed(0)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * b_std
    return wrapped.eval()


def test_merged_copy_is_the_unmerged_policy_in_fp32(lab):
    model, tokenizer = lab
    policy = _lora(model, 0.05)
    ids = torch.tensor(_prompts(tokenizer, [4]))
    merged = lora_serving.merged_copy(policy, torch.float32)
    assert not hasattr(merged, "merge_and_unload") and merged.dtype == torch.float32
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, policy(input_ids=ids).logits, atol=1e-5)
    assert any("lora_B" in n for n, _ in policy.named_parameters())  # the peft model itself was not merged


def test_merge_moves_counts_changed_entries(lab):
    model, _ = lab
    untouched = lora_serving.merge_moves(_lora(copy.deepcopy(model), 0.0), torch.bfloat16)  # B = 0: nothing changes
    assert untouched["relative_delta"] == 0.0 and untouched["moved_share"] == 0.0
    moved = lora_serving.merge_moves(_lora(model, 0.05), torch.bfloat16)
    assert moved["relative_delta"] > 0 and 0 < moved["moved_share"] <= 1


def test_unmerged_engine_keeps_its_dtypes_and_matches_fp32_sampler(lab):
    model, tokenizer = lab
    policy = _lora(model, 0.05)
    engine = lora_serving.UnmergedTrainingEngine(policy, torch.bfloat16, torch.float32)
    dtypes = {n.split(".")[-2] if "lora_" in n else "base": p.dtype for n, p in engine.model.named_parameters()}
    assert dtypes["base"] == torch.bfloat16 and {dtypes[k] for k in dtypes if k != "base"} == {torch.float32}
    merged = lora_serving.merged_copy(policy, torch.float32)
    out = rollout.InferenceEngine(merged, torch.float32).sample(_prompts(tokenizer, [3] * 4), 20, 20, keep_vocab=True,
                                                                generator=torch.Generator().manual_seed(0))
    fp32 = lora_serving.UnmergedTrainingEngine(policy, torch.float32).score(out, keep_vocab=True)
    bf16 = lora_serving.UnmergedTrainingEngine(policy, torch.bfloat16).score(out, keep_vocab=True)
    kl32 = mismatch.summary(out, fp32.logprobs, fp32.vocab)["token_kl"]
    # unmerged in fp32 is the merged policy, up to fp32 rounding (decode against prefill: ~1e-9); bf16 is not.
    # The toy's bf16 KL (~1e-8 here) is too close to fp32's rounding to compare; its tokens' log-probabilities
    # move by bf16's rounding (~1e-3), three orders above fp32's (~1e-7)
    moved32 = float((fp32.logprobs - out.logprobs).abs().max())
    moved16 = float((bf16.logprobs - out.logprobs).abs().max())
    assert abs(kl32) < 1e-8 and moved32 < 1e-5 and moved16 > 100 * moved32


def test_headroom_and_predicted_factor():
    assert overflow.headroom(65504.0) == 1.0 and overflow.headroom(0.0) == float("inf")
    assert overflow.predicted_first_log2(65504.0) == 1  # 65504 itself is finite; twice it is not
    assert overflow.predicted_first_log2(100.0) == 10  # 2^9·100 = 51200 fits, 2^10·100 does not
    assert overflow.predicted_first_log2(65505.0) == 0


def test_maxima_need_the_probe_and_record_every_place(tiny_profile, lab_cache):
    model, tokenizer = models.load(None, "dense", tiny_profile, seed=0)
    with pytest.raises(ValueError, match="attn_implementation"):
        overflow.Maxima(model)
    probed, _ = models.load(None, "dense", tiny_profile, seed=0, attn_implementation=overflow.register_probe())
    ids = torch.tensor(_prompts(tokenizer, [5]))
    with torch.no_grad(), overflow.Maxima(probed) as seen:
        probed(input_ids=ids)
    assert all(len(seen.max[p]) == tiny_profile.dense.num_layers and min(seen.max[p]) > 0 for p in overflow.PLACES)
    assert seen.first_nonfinite() is None
    with torch.no_grad(), overflow.Maxima(probed) as again:
        probed(input_ids=ids)
    assert again.max == seen.max  # each recorder starts from zero
    eager, _ = models.load(None, "dense", tiny_profile, seed=0, attn_implementation="eager")
    padded = tokenizer([task.Problem(3, 7, 5).prompt, task.Problem(3, 7, 1).prompt], return_tensors="pt", padding=True)
    with torch.no_grad():  # the probe computes what eager attention computes, causal and padding masks included
        assert torch.equal(probed(**padded).logits, eager(**padded).logits)
        with overflow.Maxima(probed):  # recording too, where it runs eager's maths itself, in fp16 as in fp32
            assert torch.equal(probed(**padded).logits, eager(**padded).logits)
            assert torch.equal(probed.half()(**padded).logits, eager.half()(**padded).logits)


def test_overflow_scan_finds_the_predicted_factor(tiny_profile, lab_cache):
    name = overflow.register_probe()
    fp32, tokenizer = models.load(None, "dense", tiny_profile, seed=0, attn_implementation=name)
    fp16, _ = models.load(None, "dense", tiny_profile, seed=0, dtype=torch.float16, attn_implementation=name)
    inputs = {"input_ids": torch.tensor(_prompts(tokenizer, [6]))}
    with torch.no_grad(), overflow.Maxima(fp32) as seen:
        fp32(**inputs)
    down_proj = fp16.model.layers[0].mlp.down_proj
    found = overflow.overflow_scan(fp16, inputs, down_proj, side="input")  # the MLP hidden activation itself
    assert found["where"] == "mlp_hidden, layer 0" and found["scaled_tensor_overflowed"]
    assert abs(found["first_log2"] - overflow.predicted_first_log2(seen.max["mlp_hidden"][0])) <= 1  # fp16 weights
    final = overflow.overflow_scan(fp16, inputs, fp16.model.norm, side="input")  # the last residual stream
    assert final["where"] == "scaled tensor"
    assert abs(final["first_log2"] - overflow.predicted_first_log2(seen.max["residual"][-1])) <= 1
    assert not down_proj._forward_pre_hooks and not down_proj._forward_hooks  # every hook is gone


@pytest.mark.parametrize("true_scale", [0.25, 8.0])
def test_clipping_scaled_gradients_shrinks_sgd_by_the_scale(true_scale):
    weight = torch.nn.Parameter(torch.zeros(4))
    target = torch.tensor([1.0, -1.0, 1.0, -1.0]) * true_scale  # loss gradient -target: norm 2·true_scale
    results = {}
    for unscale_first in (True, False):
        weight.data.zero_()
        optimizer = torch.optim.SGD([weight], lr=1.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        loss = -(weight * target).sum()
        results[unscale_first] = clipping.scaled_clipped_step([weight], optimizer, scaler, loss, 1.0, unscale_first)
    right, wrong = results[True], results[False]
    norm = 2 * true_scale
    assert right["true_norm"] == wrong["true_norm"] == norm
    assert right["norm_read"] == norm and wrong["norm_read"] == norm * 2.0 ** 10  # read before unscaling
    assert right["update_norm"] == pytest.approx(min(norm, 1.0), rel=1e-6)
    assert wrong["update_norm"] == pytest.approx(2.0 ** -10, rel=1e-6)  # clipped to 1, then divided by the scale
    assert right["stepped"] and wrong["stepped"] and right["scale"] == 2.0 ** 10


def test_one_backward_keeps_weight_and_activation_gradients(lab):
    from labutils import gradients

    model, tokenizer = lab
    enc = tokenizer([task.Problem(3, 7, 2).prompt + task.Problem(3, 7, 2).completion] * 2, return_tensors="pt")
    model.eval()
    grads = gradients.one_backward(model, dict(enc), enc["input_ids"])
    matrices = sum(p.numel() for p in model.parameters() if p.ndim == 2)
    assert grads["weights"].numel() == matrices and grads["activations"].numel() > 0
    assert all(p.grad is None for p in model.parameters()) and not model.training  # nothing left behind


def test_flushed_share_is_what_the_cast_zeroes():
    from labutils import gradients

    tiny = torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps  # 2^-24
    values = torch.tensor([0.0, tiny / 2, tiny * 0.51, 1.0, -tiny / 4], dtype=torch.float64)
    assert gradients.flushed_share(values) == 0.5  # ties to even: half the subnormal rounds to 0, 0.51 of it up
    assert gradients.flushed_share(values, torch.bfloat16) == 0.0  # bf16's range is fp32's
    with pytest.raises(ValueError):
        gradients.flushed_share(torch.zeros(3))
