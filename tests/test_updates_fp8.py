"""labutils.updates (Adam's step, lost updates, the fp16 eps floor) and labutils.fp8 on tiny inputs."""
import math

import pytest
import torch

from labutils import fp8, updates


def _adamw_step(weights, grads, dtype, **kwargs):
    param = torch.nn.Parameter(torch.tensor(weights, dtype=dtype))
    param.grad = torch.tensor(grads, dtype=dtype)
    optimizer = torch.optim.AdamW([param], **kwargs)
    return param, optimizer


def test_adam_update_is_the_step_taken():
    # betas (0.5, 0.75), g = 0.5: m = 0.25, v = 0.0625; bias-corrected m̂ = 0.5, v̂ = 0.25, so m̂/√v̂ = 1 exactly
    param, optimizer = _adamw_step([2.0], [0.5], torch.float32, lr=0.125, betas=(0.5, 0.75), eps=0.0,
                                   weight_decay=0.5)
    assert updates.adam_update(optimizer, param) is None  # no state before the first step
    before = param.detach().clone()
    optimizer.step()
    # AdamW: w <- w (1 - lr wd) - lr m̂/√v̂ = 2 · 0.9375 - 0.125 = 1.75
    assert param.item() == 1.75
    assert updates.adam_direction(optimizer, param).tolist() == [1.0]
    assert updates.adam_update(optimizer, param, before).tolist() == [0.25]  # lr + lr·wd·2: what moved
    assert (before - param.detach()).tolist() == [0.25]
    assert updates.adam_update(optimizer, param).tolist() == [0.125 + 0.0625 * 1.75]  # decay on the new weight


def test_lost_update_counter_counts_updates_below_half_an_ulp():
    # bf16 weights 1 and 1/64 (half-ulps 2^-8 and 2^-14), each asked to move by about lr = 1e-3
    model = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1 / 64]]))
    model.weight.grad = torch.ones_like(model.weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    counter = updates.lost_update_counter()
    counter.on_pre_optimizer_step(None, None, None, model=model)
    optimizer.step()
    counter.on_optimizer_step(None, None, None, model=model, optimizer=optimizer)
    assert model.weight[0, 0].item() == 1.0 and model.weight[0, 1].item() != 1 / 64
    assert (counter.meant, counter.lost, counter.below_half_ulp) == (2, 1, 1)
    assert counter.fraction == 0.5 and counter.per_step == [0.5]


def test_lost_update_counter_loses_nothing_in_fp32():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1 / 64]]))
    model.weight.grad = torch.ones_like(model.weight)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter = updates.lost_update_counter()
    counter.on_pre_optimizer_step(None, None, None, model=model)
    optimizer.step()
    counter.on_optimizer_step(None, None, None, model=model, optimizer=optimizer)
    assert (counter.meant, counter.lost, counter.below_half_ulp) == (2, 0, 0) and counter.fraction == 0.0


def test_half_ulp_of_one():
    assert updates.half_ulp(torch.tensor([1.0], dtype=torch.bfloat16)).tolist() == [2**-8]
    assert updates.half_ulp(torch.tensor([1.0], dtype=torch.float16)).tolist() == [2**-11]


def test_v_flush_bound_matches_torch_adam_in_fp16():
    assert updates.smallest_subnormal(torch.float16) == 2**-24
    bound = updates.v_flush_bound(0.999)
    assert bound == pytest.approx(math.sqrt(2**-25 / 1e-3))
    below, above = torch.tensor(bound).half(), torch.tensor(bound).half()
    below = float(torch.nextafter(below, torch.tensor(0.0).half()))
    above = float(torch.nextafter(above, torch.tensor(1.0).half()))
    for g, flushed in [(below, True), (above, False)]:
        param, optimizer = _adamw_step([1.0], [g], torch.float16, lr=1e-3)
        optimizer.step()
        assert (optimizer.state[param]["exp_avg_sq"].item() == 0.0) is flushed
        assert math.isfinite(param.item()) is not flushed  # v = 0 and eps = 0 in fp16: -inf


def test_min_adam_eps_bounds_the_flushed_step_by_lr():
    eps = updates.min_adam_eps(0.999)
    assert eps == updates.v_flush_bound(0.999)
    assert updates.min_adam_eps(0.999, max_step_over_lr=10.0) == pytest.approx(eps / 10)
    param, optimizer = _adamw_step([1.0], [5e-3], torch.float16, lr=1e-3, eps=eps, weight_decay=0.0)
    optimizer.step()
    assert optimizer.state[param]["exp_avg_sq"].item() == 0.0
    step = 1.0 - param.item()
    assert 0 < step <= 1e-3 + 2**-11  # lr, up to half an fp16 ulp at 1


def test_round_trip_without_scale_saturates():
    x = torch.tensor([1.0, 500.0, -1000.0, 0.0])
    assert fp8.round_trip(x, torch.float8_e4m3fn, "none").tolist() == [1.0, 448.0, -448.0, 0.0]
    assert fp8.round_trip(torch.tensor([1e6]), torch.float8_e5m2, "none").tolist() == [57344.0]


def test_round_trip_per_tensor_scale():
    # amax 56 = 448 / 8: the scale is exactly 1/8; 0.1 / (1/8) = 0.8 rounds to 0.8125 in E4M3
    x = torch.tensor([56.0, 7.0, -3.5, 0.1])
    assert fp8.round_trip(x, torch.float8_e4m3fn, "tensor").tolist() == [56.0, 7.0, -3.5, 0.1015625]
    assert fp8.round_trip(torch.zeros(3), torch.float8_e4m3fn, "tensor").tolist() == [0.0, 0.0, 0.0]


def test_round_trip_per_block_scale_fits_each_block():
    # second block's amax is 448 · 2^-12: its small value keeps a normal E4M3 number (4.5), not a subnormal
    x = torch.tensor([56.0, 0.1, 448 * 2.0**-12, 0.0011])
    per_tensor = fp8.round_trip(x, torch.float8_e4m3fn, "tensor")
    per_block = fp8.round_trip(x, torch.float8_e4m3fn, "block", block=2)
    assert per_tensor[3].item() == 5 * 2.0**-9 / 8  # 0.0088 rounds to 5 subnormal steps of 2^-9
    assert per_block.tolist() == [56.0, 0.1015625, 448 * 2.0**-12, 4.5 * 2.0**-12]
    odd = fp8.round_trip(x[:3], torch.float8_e4m3fn, "block", block=2)  # a padded last block
    assert odd.tolist() == per_block[:3].tolist()


def test_round_trip_rejects_bad_arguments():
    with pytest.raises(ValueError, match="choose one of"):
        fp8.round_trip(torch.ones(2), torch.float8_e4m3fn, "row")
    with pytest.raises(ValueError, match="positive"):
        fp8.round_trip(torch.ones(2), torch.float8_e4m3fn, "block", block=0)
