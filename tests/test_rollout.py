import pytest
import torch

from labutils import mismatch, models, rollout, task


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
    logprobs, vocab = scorer.score(out, keep_vocab=True, order=torch.tensor([2, 0, 3, 1]))
    assert (logprobs - out.logprobs)[out.mask].abs().max() < 1e-4
    assert mismatch.summary(out, logprobs, vocab)["token_kl"] < 1e-8


def test_bf16_engines_disagree_more_than_fp32(lab):
    model, tokenizer = lab
    prompts = _prompts(tokenizer, [3] * 8)
    gaps = {}
    for dtype in (torch.float32, torch.bfloat16):
        out = rollout.InferenceEngine(model, dtype).sample(prompts, 40, 40, generator=torch.Generator().manual_seed(1))
        logprobs, _ = rollout.TrainingEngine(model, dtype).score(out)
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
