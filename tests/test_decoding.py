import pytest
import torch
import torch.nn.functional as F

from labutils import decoding, rollout


def _one_query(dtype, batch=3, heads=6, groups=2, keys=70, width=16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, h, n, width, generator=g).to(dtype)
               for h, n in ((heads, 1), (groups, keys), (groups, keys)))
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    mask[0, ..., :9] = False  # a left-padded row
    return q, k, v, mask


def _reference(q, k, v, mask):
    repeat = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(repeat, 1),
                                         v.double().repeat_interleave(repeat, 1), attn_mask=mask)
    return out.transpose(1, 2)


def test_one_query_attention_is_exact_in_fp32_and_within_rounding_in_16_bits():
    module = torch.nn.Module()
    q, k, v, mask = _one_query(torch.float32)
    out, _ = decoding._attention(module, q, k, v, mask)
    assert (out.double() - _reference(q, k, v, mask)).abs().max() < 1e-5
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, mask = _one_query(dtype)
        out, _ = decoding._attention(module, q, k, v, mask)
        reference = _reference(q, k, v, mask)
        unit = torch.finfo(dtype).eps  # the probabilities and the output are each rounded once to the dtype
        assert out.dtype == dtype and (out.double() - reference).abs().max() < 4 * unit * reference.abs().max()


def test_one_query_attention_rounds_like_the_fused_kernel_of_the_trainer():
    # the trainer's whole-sequence kernel, read at the last position, against the sampler's one-query step:
    # only the order of the fp32 additions differs, so they disagree far less than either does with fp64
    g = torch.Generator().manual_seed(1)
    q = (2 * torch.randn(4, 4, 90, 32, generator=g)).bfloat16()
    k, v = (2 * torch.randn(4, 2, 90, 32, generator=g)).bfloat16(), torch.randn(4, 2, 90, 32, generator=g).bfloat16()
    fused = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(2, 1),
                                           v.double().repeat_interleave(2, 1), is_causal=True)
    step, _ = decoding._attention(torch.nn.Module(), q[:, :, -1:], k.float(), v.float(), None)
    step = step.transpose(1, 2).double()
    to_fused = (step - fused[:, :, -1:].double()).abs().mean()
    assert to_fused < (fused[:, :, -1:].double() - exact[:, :, -1:]).abs().mean() / 10


def test_the_cache_grows_in_place_and_keeps_the_selected_rows():
    cache = decoding.cache()
    g = torch.Generator().manual_seed(0)
    written = []
    for n in (50, 1, 1, 30):  # past the first capacity of 64
        k = torch.randn(4, 2, n, 8, generator=g).bfloat16()
        keys, values = cache.update(k, -k, layer_idx=0)
        written.append(k)
    expected = torch.cat(written, dim=2).float()
    assert torch.equal(keys, expected) and torch.equal(values, -expected) and cache.get_seq_length() == 82
    cache.batch_select_indices(torch.tensor([3, 1]))
    keys, _ = cache.update(torch.zeros(2, 2, 1, 8, dtype=torch.bfloat16), torch.zeros(2, 2, 1, 8), layer_idx=0)
    assert torch.equal(keys[:, :, :82], expected[[3, 1]]) and keys.shape[2] == 83


def test_draws_follow_the_probabilities_and_never_pick_an_impossible_token():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    rows = 20_000
    everyone = torch.arange(rows)
    tokens = rollout._draw(probs.log().expand(rows, 4), everyone, rows, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=4).double()
    stderr = (rows * probs.double() * (1 - probs.double())).sqrt()
    assert counts[1] == 0 and ((counts - rows * probs).abs() <= 5 * stderr + 1e-9).all()
    with pytest.raises(RuntimeError, match="not finite"):
        rollout._draw(torch.tensor([[float("nan"), 0.0]]), torch.arange(1), 1, None)


def test_a_rows_draw_depends_on_its_index_and_step_not_on_which_rows_are_left():
    logp = torch.log_softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(1)), -1)
    whole = rollout._draw(logp, torch.arange(6), 6, torch.Generator().manual_seed(2))
    left = torch.tensor([1, 4, 5])  # the others have ended
    assert torch.equal(rollout._draw(logp[left], left, 6, torch.Generator().manual_seed(2)), whole[left])


def test_engines_with_identical_weights_write_identical_completions_when_rows_end_at_different_steps(
        tiny_profile, lab_cache):
    from labutils import models

    model, _ = models.load(None, "dense", tiny_profile, seed=0)
    ids = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 1]]
    budgets = [3, 12, 7, 12]  # rows leave the batch at steps 3 and 7; the others must not notice
    whole = rollout.InferenceEngine(model, torch.float32).sample(ids, budgets, budgets,
                                                                  generator=torch.Generator().manual_seed(5))
    alone = rollout.InferenceEngine(model, torch.float32).sample(ids, 12, 12, generator=torch.Generator().manual_seed(5))
    assert whole.lengths.tolist() == budgets
    for row, n in enumerate(budgets):
        assert torch.equal(whole.completion_ids[row, :n], alone.completion_ids[row, :n])


def test_only_the_samplers_copy_runs_the_decode_attention(tiny_profile, lab_cache):
    from labutils import models

    model, _ = models.load(None, "dense", tiny_profile, seed=0)
    before = model.config._attn_implementation
    sampler = rollout.InferenceEngine(model, torch.bfloat16)
    assert sampler.model.config._attn_implementation == decoding.ATTENTION
    assert model.config._attn_implementation == before  # the trainer keeps its own
