import pytest
import torch

from labutils import mismatch, models, moe, rollout, task


@pytest.fixture
def lab(tiny_profile, lab_cache):
    return models.load(None, "dense", tiny_profile, seed=0)


def _prompts(tokenizer, walks):
    return [tokenizer(task.Problem(3, 7, n).prompt, add_special_tokens=False)["input_ids"] for n in walks]


def test_fp32_engines_agree_and_lengths_follow_the_budget(lab):
    model, tokenizer = lab
    prompts = _prompts(tokenizer, [1, 5, 12, 40])  # prompts of different widths: left padding matters
    budget = torch.tensor([7, 30, 19, 50])
    sampler = rollout.InferenceEngine(model, torch.float32)
    out = sampler.sample(prompts, budget, budget, generator=torch.Generator().manual_seed(0), keep_vocab=True)
    assert out.lengths.tolist() == budget.tolist()
    assert torch.allclose(out.vocab_logprobs.exp().sum(-1)[out.mask], torch.ones(int(out.mask.sum())), atol=1e-5)
    scorer = rollout.TrainingEngine(model, torch.float32, micro_batch=3)
    logprobs, vocab, _ = scorer.score(out, keep_vocab=True, order=torch.tensor([2, 0, 3, 1]))
    assert (logprobs - out.logprobs)[out.mask].abs().max() < 1e-4
    assert abs(mismatch.summary(out, logprobs, vocab)["token_kl"]) < 1e-7  # fp32 rounding in the log-softmax


def test_rescoring_takes_causal_attention_without_a_mask_and_matches_the_masked_forward(lab, monkeypatch):
    model, tokenizer = lab
    out = rollout.InferenceEngine(model, torch.float32).sample(_prompts(tokenizer, [1, 5, 12]), torch.tensor([9, 30, 4]),
                                                               generator=torch.Generator().manual_seed(0))
    ids, mask, _ = rollout.pack(out, torch.arange(3), rollout.special_ids(model.config)[0])
    calls = []
    attention = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return attention(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        packed = model(**rollout.packed_inputs(ids)).logits
        assert calls and set(calls) == {(True, True)}  # the fused causal kernel, no mask built
        masked = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(packed[mask.bool()], masked[mask.bool()])  # the same logits on every real token


def test_bf16_engines_disagree_more_than_fp32(lab):
    model, tokenizer = lab
    prompts = _prompts(tokenizer, [3] * 8)
    gaps = {}
    for dtype in (torch.float32, torch.bfloat16):
        out = rollout.InferenceEngine(model, dtype).sample(prompts, 40, 40, generator=torch.Generator().manual_seed(1))
        logprobs = rollout.TrainingEngine(model, dtype).score(out).logprobs
        gaps[dtype] = float((logprobs - out.logprobs)[out.mask].abs().mean())
    assert gaps[torch.bfloat16] > 10 * gaps[torch.float32]


def test_eos_ends_a_row_and_its_mask(lab):
    model, tokenizer = lab
    out = rollout.InferenceEngine(model, torch.float32).sample(_prompts(tokenizer, [2] * 16), 60,
                                                               generator=torch.Generator().manual_seed(0))
    for row, n in zip(out.completion_ids, out.lengths):
        if n < out.completion_ids.shape[1]:
            assert row[n - 1] == tokenizer.eos_token_id


def test_sync_copies_the_trainers_weights(lab):
    model, _ = lab
    engine = rollout.InferenceEngine(model, torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    engine.sync(model)
    assert torch.equal(engine.model.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_bad_precisions_and_budgets_are_clear_errors(lab):
    model, tokenizer = lab
    with pytest.raises(ValueError, match="not an engine precision"):
        rollout.engine_dtype("fp8")
    with pytest.raises(ValueError, match="min_new_tokens <= max_new_tokens"):
        rollout.InferenceEngine(model, torch.float32).sample(_prompts(tokenizer, [1]), 5, 6)


def test_moe_routing_is_recorded_identically_by_both_fp32_engines(tiny_profile, lab_cache):
    model, tokenizer = models.load(None, "moe", tiny_profile, seed=0)
    prompts = _prompts(tokenizer, [1, 4, 30])
    out = rollout.InferenceEngine(model, torch.float32).sample(prompts, 25, 25, keep_experts=True,
                                                               generator=torch.Generator().manual_seed(0))
    scored = rollout.TrainingEngine(model, torch.float32, micro_batch=2).score(out, keep_experts=True)
    layers, k = tiny_profile.moe.num_layers, tiny_profile.moe.experts_per_token
    assert out.experts.shape == (3, 25, layers, k) and scored.experts.shape == out.experts.shape
    assert (out.experts >= 0).all()
    assert moe.flip_rate(out.experts, scored.experts, out.mask) == 0.0


def test_routing_replay_makes_the_trainer_use_the_samplers_experts(tiny_profile, lab_cache):
    import copy

    model, tokenizer = models.load(None, "moe", tiny_profile, seed=0)
    prompts = _prompts(tokenizer, [1, 4, 30])
    other = copy.deepcopy(model)  # a sampler whose routers disagree with the trainer's on purpose
    with torch.no_grad():
        for router in moe.routers(other):
            router.weight.neg_()
    out = rollout.InferenceEngine(other, torch.float32).sample(prompts, 40, 40, keep_experts=True,
                                                               generator=torch.Generator().manual_seed(0))
    assert out.prompt_experts.shape[:2] == (3, max(len(p) for p in prompts))
    assert (out.prompt_experts[0, : -len(prompts[0])] == -1).all()  # left padding has no routing
    scorer = rollout.TrainingEngine(model, torch.float32, micro_batch=2)
    free = scorer.score(out, keep_experts=True)
    replayed = scorer.score(out, keep_experts=True, replay=True)
    assert moe.flip_rate(out.experts, free.experts, out.mask) > 0.5
    assert moe.flip_rate(out.experts, replayed.experts, out.mask) == 0.0
    with pytest.raises(ValueError, match="keep_experts=True"):
        scorer.score(rollout.InferenceEngine(model, torch.float32).sample(prompts, 5, 5), replay=True)


def test_router_in_fp32_keeps_the_model_dtype_outside_the_router(tiny_profile, lab_cache):
    model, _ = models.load(None, "moe", tiny_profile, seed=0, dtype=torch.bfloat16)
    assert moe.router_in_fp32(model) == tiny_profile.moe.num_layers
    assert all(r.weight.dtype == torch.float32 for r in moe.routers(model))
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.dtype == torch.bfloat16


def test_flip_rate_counts_sets_not_order():
    a = torch.tensor([[[[0, 1]], [[2, 3]]]])  # batch 1, 2 tokens, 1 layer, top-2
    b = torch.tensor([[[[1, 0]], [[2, 4]]]])
    assert moe.flip_rate(a, b, torch.ones(1, 2)) == 0.5
    with pytest.raises(ValueError, match="no routing"):
        moe.flip_rate(a, b, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="no top-k router"):
        moe.routers(torch.nn.Linear(2, 2))


def test_engines_in_16_bits_keep_the_rotary_frequencies_in_fp32(lab):
    """Only weights and activations take the engine's dtype: a bf16 inv_freq would add a phase error that grows
    with position, which no serving or training stack has."""
    model, _ = lab
    source = dict(model.named_buffers())
    for engine in (rollout.InferenceEngine(model, torch.bfloat16), rollout.TrainingEngine(model, torch.float16)):
        frequencies = {n: b for n, b in engine.model.named_buffers() if n.endswith("inv_freq")}
        assert frequencies and all(b.dtype == torch.float32 for b in frequencies.values())
        assert all(torch.equal(b, source[n]) for n, b in frequencies.items())
        assert next(engine.model.parameters()).dtype != torch.float32
