"""trl's, verl's and NeMo-RL's mismatch metrics on hand-made batches whose answers are known exactly."""
import ast
import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from labutils import framework_metrics

TRL_DEFAULTS = {"mode": "sequence_mask", "clip_min": None, "clip_max": 3.0}


def batch(shift: float, sequences: int = 3, tokens: int = 4):
    """log μ of varied sizes, log π = log μ + `shift` on every token, every token real."""
    log_mu = -torch.arange(1, sequences * tokens + 1, dtype=torch.float64).reshape(sequences, tokens) / 5
    return log_mu + shift, log_mu, torch.ones(sequences, tokens)


def test_identical_log_probabilities_give_no_mismatch_in_any_framework():
    found = framework_metrics.measure(*batch(0.0))
    assert set(found) == {"trl", "verl", "NeMo-RL"}
    assert found["trl"]["sampling/sampling_logp_difference/mean"] == 0
    assert found["trl"]["sampling/sampling_logp_difference/max"] == 0
    assert found["verl"]["rollout_corr/kl"] == 0 and found["verl"]["rollout_corr/k3_kl"] == 0
    # verl's and NeMo-RL's means divide by the count plus 1e-8: off by about 1e-8 where the answer is 0 or 1
    assert found["verl"]["rollout_corr/chi2_token"] == pytest.approx(0, abs=1e-9)
    assert found["verl"]["rollout_corr/chi2_seq"] == 0
    assert found["verl"]["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1, abs=1e-7)
    assert found["NeMo-RL"]["train/token_mult_prob_error"] == pytest.approx(1, abs=1e-9)
    assert found["NeMo-RL"]["train/gen_kl_error"] == found["NeMo-RL"]["train/policy_kl_error"] == 0
    # the mixture's log, log(½e^a + ½e^a), comes back as a only to rounding
    assert found["NeMo-RL"]["train/js_divergence_error"] == pytest.approx(0, abs=1e-15)


def test_a_known_shift_gives_the_known_values():
    d, tokens = -0.1, 4
    log_pi, log_mu, mask = batch(d, tokens=tokens)
    trl = framework_metrics.trl(log_pi, log_mu, mask, TRL_DEFAULTS)
    assert trl["sampling/sampling_logp_difference/mean"] == pytest.approx(0.1)
    assert trl["sampling/sampling_logp_difference/max"] == pytest.approx(0.1)
    for stat in ("min", "mean", "max"):  # one weight per completion, e^(4·−0.1), under the cap of 3
        assert trl[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(math.exp(tokens * d))
    verl = framework_metrics.verl(log_pi, log_mu, mask)
    assert verl["rollout_corr/kl"] == pytest.approx(-d)
    assert verl["rollout_corr/k3_kl"] == pytest.approx(math.exp(d) - d - 1)
    assert verl["rollout_corr/chi2_token"] == pytest.approx(math.exp(2 * d) - 1)
    assert verl["rollout_corr/chi2_seq"] == pytest.approx(math.exp(2 * tokens * d) - 1)
    assert verl["rollout_corr/log_ppl_diff"] == pytest.approx(-d)
    assert verl["rollout_corr/ppl_ratio"] == pytest.approx(math.exp(-d))
    assert verl["rollout_corr/rollout_is_mean"] == pytest.approx(math.exp(tokens * d))
    assert verl["rollout_corr/rollout_is_ratio_fraction_high"] == 0  # e^−0.4 is inside [1/2, 2]
    nemo = framework_metrics.nemo_rl(log_pi, log_mu, mask)
    assert nemo["train/token_mult_prob_error"] == pytest.approx(math.exp(-d))
    assert nemo["train/gen_kl_error"] == pytest.approx(math.exp(d) - 1 - d)
    assert nemo["train/policy_kl_error"] == pytest.approx(math.exp(-d) - 1 + d)
    assert nemo["train/sampling_importance_ratio"] == pytest.approx(math.exp(d))
    mixture = math.log((1 + math.exp(-d)) / 2)  # log m − log π, the same on every token
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
    assert nemo["train/js_divergence_error"] == pytest.approx(0.5 * k3(-mixture) + 0.5 * k3(-d - mixture))


def test_trl_masks_a_completion_past_its_cap_and_the_mask_hides_padding():
    log_pi, log_mu, mask = batch(0.5, sequences=2, tokens=3)  # e^1.5 > 3: every completion masked to 0
    assert framework_metrics.trl(log_pi, log_mu, mask, TRL_DEFAULTS)["sampling/importance_sampling_ratio/max"] == 0
    mask[1, 2] = 0
    log_pi[1, 2] += 5.0  # a padded position's difference is never counted
    found = framework_metrics.trl(log_pi, log_mu, mask, {"mode": "token_truncate", "clip_min": None, "clip_max": 3.0})
    assert found["sampling/sampling_logp_difference/max"] == pytest.approx(0.5)
    assert found["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(0.5))
    verl = framework_metrics.verl(log_pi, log_mu, mask, rollout_is="token")
    assert verl["rollout_corr/kl"] == pytest.approx(-0.5)
    assert verl["rollout_corr/rollout_is_ratio_fraction_high"] == 0  # e^0.5 < 2


def test_verl_sequence_weights_past_the_threshold_are_counted_and_clamped_for_the_ess():
    log_mu = torch.full((2, 2), -1.0, dtype=torch.float64)
    log_pi = log_mu + torch.tensor([[0.5, 0.5], [0.0, 0.0]], dtype=torch.float64)  # weights e^1 and 1
    found = framework_metrics.verl(log_pi, log_mu, torch.ones(2, 2))
    assert found["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5
    assert found["rollout_corr/rollout_is_max"] == pytest.approx(math.e)
    # clamped to 2 and 1: normalised by their mean 1.5, the ESS share is 1.5² / ((4 + 1) / 2)
    assert found["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.5 ** 2 / 2.5)


def trl_metric_lines():
    """trl's own lines that compute the weights and log the sampling metrics, compiled to run on their own."""
    from trl import GRPOTrainer

    source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    blocks = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.If)
              and ast.unparse(node.test) == "self.use_vllm and self.vllm_importance_sampling_correction"]
    wanted = [b for b in blocks
              if "per_token_logps_diff" in ast.unparse(b) or "sampling_logp_difference" in ast.unparse(b)]
    if len(wanted) != 2:
        pytest.fail("trl's importance-sampling or metric block was not found: the installed trl logs them elsewhere")
    return [compile(ast.Module(body=b.body, type_ignores=[]), "trl", "exec")
            for b in sorted(wanted, key=lambda b: b.lineno)]  # the weights first, then the metrics of them


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"])
def test_trl_metrics_equal_what_the_installed_trls_own_lines_log(mode):
    from trl.trainer import grpo_trainer

    torch.manual_seed(0)
    sampler = -torch.rand(5, 7) * 3
    trainer = sampler + torch.randn(5, 7) * 0.3
    mask = torch.ones(5, 7)
    mask[1, 4:] = 0
    metrics = defaultdict(list)
    scope = {"torch": torch, "math": math, "old_per_token_logps": trainer, "sampling_per_token_logps": sampler,
             "completion_mask": mask, "tool_mask": None, "device": "cpu", "mode": "train",
             "nanmin": grpo_trainer.nanmin, "nanmax": grpo_trainer.nanmax,
             "self": SimpleNamespace(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=None,
                                     vllm_importance_sampling_clip_max=3.0, _metrics={"train": metrics},
                                     accelerator=SimpleNamespace(gather=lambda t: t.reshape(1)))}
    for lines in trl_metric_lines():
        exec(lines, scope)
    ours = framework_metrics.trl(trainer, sampler, mask, {"mode": mode, "clip_min": None, "clip_max": 3.0})
    assert set(ours) == set(metrics)
    for name, value in ours.items():
        assert value == pytest.approx(metrics[name][0], rel=1e-5)  # trl's float32 against our float64


def test_a_bad_batch_is_refused_in_one_sentence():
    log_pi, log_mu, mask = batch(0.0)
    with pytest.raises(ValueError, match="share one"):
        framework_metrics.measure(log_pi[:, :2], log_mu, mask)
    with pytest.raises(ValueError, match="no tokens"):
        framework_metrics.measure(log_pi, log_mu, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="token or sequence"):
        framework_metrics.verl(log_pi, log_mu, mask, rollout_is="geometric")
