"""What trl, verl and NeMo-RL log about the sampler–trainer mismatch, each in its framework's own definition.

Every quantity here is computed from the same three tensors of one batch ([B, T] each): log π, the
trainer's log-probability of each sampled token; log μ, the sampler's; and a mask of the real tokens.
Each framework's function follows the lines of its pinned source file below, at that framework's
default settings, for one batch on one process (what a single-GPU run logs for one step, where a step
trains on one batch). The arithmetic is float64 where the frameworks compute in their log-probabilities' dtype (fp32):
their logged value of a tiny k3 or χ² can differ from these in the last digits.
"""
from __future__ import annotations

import functools
import math

import torch

from . import sampling_correction

# trl: the metric block and the correction it reports on. The installed trl's defaults (1.16 in this lab) are
# read at run time by `sampling_correction.defaults()`; its lines equal the pinned ones but for NaN guards on
# tokens vLLM could not score, which the book's engines never leave (tests/test_framework_metrics.py runs them).
TRL_SOURCE = ("https://github.com/huggingface/trl/blob/f2cd57710ae345ea6428ae95363267fcf38a3dc8/"
              "trl/trainer/grpo_trainer.py#L2779-L2813")
TRL_CORRECTION_SOURCE = ("https://github.com/huggingface/trl/blob/f2cd57710ae345ea6428ae95363267fcf38a3dc8/"
                         "trl/trainer/grpo_trainer.py#L2579-L2624")
VERL_SOURCE = ("https://github.com/volcengine/verl/blob/0b4e2a814129c07f016787cbce476132ceb6c5cb/"
               "verl/trainer/ppo/rollout_corr_helper.py#L318-L813")
VERL_DEFAULTS_SOURCE = ("https://github.com/volcengine/verl/blob/0b4e2a814129c07f016787cbce476132ceb6c5cb/"
                        "verl/trainer/config/algorithm.py#L161-L169")
NEMO_SOURCE = ("https://github.com/NVIDIA-NeMo/RL/blob/005a098a5fc04317a0ceb792e66a8b8076804618/"
               "nemo_rl/algorithms/loss_functions.py#L199-L587")
NEMO_DEFAULTS_SOURCE = ("https://github.com/NVIDIA-NeMo/RL/blob/005a098a5fc04317a0ceb792e66a8b8076804618/"
                        "examples/configs/grpo_math_1B.yaml#L48-L69")
SOURCES = {"trl": TRL_SOURCE, "verl": VERL_SOURCE, "NeMo-RL": NEMO_SOURCE}

VERL_DEFAULTS = {"rollout_is": "sequence", "rollout_is_threshold": 2.0}  # RolloutCorrectionConfig's
VERL_SAFETY_BOUND = 20.0  # verl clamps log-ratios to ±20 before exponentiating (rollout_corr_helper.py, L79)
NEMO_DEFAULTS = {"reference_policy_kl_type": "k3"}  # grpo_math_1B.yaml; no truncation, token-level ratios
EPSILON = 1e-8  # what verl's and NeMo-RL's masked means add to their denominators


def _inputs(log_pi: torch.Tensor, log_mu: torch.Tensor, mask: torch.Tensor):
    """The three tensors in float64, checked to share one [B, T] shape and to hold a real token."""
    if not (log_pi.shape == log_mu.shape == mask.shape) or log_pi.dim() != 2:
        raise ValueError(f"log_pi, log_mu and mask must share one [sequences, tokens] shape, got "
                         f"{tuple(log_pi.shape)}, {tuple(log_mu.shape)} and {tuple(mask.shape)}.")
    if not bool(mask.bool().any()):
        raise ValueError("the mask selects no tokens; every framework needs at least one real token.")
    return log_pi.double(), log_mu.double(), mask.double()


@functools.lru_cache(maxsize=1)
def trl_defaults() -> dict:
    """The installed trl's importance-sampling settings (mode, clip_min, clip_max), read once."""
    return sampling_correction.defaults()


def trl(log_pi: torch.Tensor, log_mu: torch.Tensor, mask: torch.Tensor, settings: dict | None = None) -> dict:
    """trl's GRPOTrainer sampling metrics (with `use_vllm` and its correction on): the mean and max of
    |log π − log μ| over real tokens, and the min, mean and max of the corrected weights, one per completion
    in the sequence modes and one per real token in the token modes; `settings` as `trl_defaults()`."""
    log_pi, log_mu, mask = _inputs(log_pi, log_mu, mask)
    settings = trl_defaults() if settings is None else settings
    real = mask.bool()
    delta = (log_pi - log_mu).abs()[real]
    weight = sampling_correction.weights(log_pi - log_mu, mask, settings["mode"], settings["clip_min"],
                                         settings["clip_max"])
    flat = weight.flatten() if settings["mode"].startswith("sequence") else weight[real]
    return {"sampling/sampling_logp_difference/mean": float(delta.mean()),
            "sampling/sampling_logp_difference/max": float(delta.max()),
            "sampling/importance_sampling_ratio/min": float(flat.min()),
            "sampling/importance_sampling_ratio/mean": float(flat.mean()),
            "sampling/importance_sampling_ratio/max": float(flat.max())}


def _verl_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """verl_F.masked_mean: the masked sum over the mask's count plus 1e-8."""
    total = torch.where(mask.bool(), values, 0.0) * mask
    if axis is None:
        return total.sum() / (mask.sum() + EPSILON)
    return total.sum(axis) / (mask.sum(axis) + EPSILON)


def verl_offpolicy(log_pi: torch.Tensor, log_mu: torch.Tensor, mask: torch.Tensor) -> dict:
    """verl's `compute_offpolicy_metrics`: k1 and k3 estimates of KL[μ‖π], each engine's perplexity and
    their log difference per sequence, and χ² = E[ρ²] − 1 of the token and of the sequence weights ρ = π/μ."""
    log_pi, log_mu, mask = _inputs(log_pi, log_mu, mask)
    found = {}
    mean_training = _verl_mean(log_pi, mask, axis=-1)
    found["training_ppl"] = float(torch.exp(-mean_training).mean())
    found["training_log_ppl"] = float((-mean_training).mean())
    found["kl"] = float(_verl_mean(log_mu - log_pi, mask))
    log_ratio = log_pi - log_mu
    found["k3_kl"] = float(_verl_mean(torch.exp(log_ratio) - log_ratio - 1, mask))
    mean_rollout = _verl_mean(log_mu, mask, axis=-1)
    found["rollout_ppl"] = float(torch.exp(-mean_rollout).mean())
    found["rollout_log_ppl"] = float((-mean_rollout).mean())
    log_ppl_diff = mean_rollout - mean_training
    found.update(log_ppl_diff=float(log_ppl_diff.mean()), log_ppl_abs_diff=float(log_ppl_diff.abs().mean()),
                 log_ppl_diff_max=float(log_ppl_diff.max()), log_ppl_diff_min=float(log_ppl_diff.min()),
                 ppl_ratio=float(torch.exp(log_ppl_diff).mean()))
    rho = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
    found["chi2_token"] = float(_verl_mean(rho.square(), mask) - 1.0)
    sums = (torch.where(mask.bool(), log_ratio, 0.0) * mask).sum(-1)
    found["chi2_seq"] = float(torch.exp(2.0 * sums.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)).mean() - 1.0)
    return found


def verl_weights(log_pi: torch.Tensor, log_mu: torch.Tensor, mask: torch.Tensor, rollout_is: str = "sequence",
                 threshold: float = 2.0) -> dict:
    """verl's `compute_is_metrics` on its weights before truncation (`compute_rollout_correction_weights`):
    their mean, extremes, share beyond threshold and 1/threshold, and the effective sample size of the
    weights clamped to [1/threshold, threshold], as a share of the real tokens (sequence weights repeat
    over their tokens)."""
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"rollout_is={rollout_is!r} is not one of verl's levels; choose token or sequence.")
    log_pi, log_mu, mask = _inputs(log_pi, log_mu, mask)
    log_ratio, real = log_pi - log_mu, mask.bool()
    if rollout_is == "token":
        for_metrics = log_ratio
        weights = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
    else:
        for_metrics = (torch.where(real, log_ratio, 0.0) * mask).sum(-1, keepdim=True)
        weights = torch.exp(for_metrics.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)).expand_as(log_ratio)
    weights = weights * mask
    low, found = 1.0 / threshold, {}
    if rollout_is == "sequence":  # extremes and shares in log space, over sequences
        found["rollout_is_max"] = float(torch.exp(for_metrics.max().clamp(max=VERL_SAFETY_BOUND)))
        found["rollout_is_min"] = float(torch.exp(for_metrics.min()))
        found["rollout_is_mean"] = float(_verl_mean(weights, mask))
        found["rollout_is_ratio_fraction_high"] = float((for_metrics > math.log(threshold)).double().mean())
        found["rollout_is_ratio_fraction_low"] = float((for_metrics < math.log(low)).double().mean())
    else:
        found["rollout_is_mean"] = float(_verl_mean(weights, mask))
        found["rollout_is_ratio_fraction_high"] = float(_verl_mean((weights > threshold).double(), mask))
        found["rollout_is_ratio_fraction_low"] = float(_verl_mean((weights < low).double(), mask))
        found["rollout_is_max"] = float(weights.masked_fill(~real, -math.inf).max())
        found["rollout_is_min"] = float(weights.masked_fill(~real, math.inf).min())
    clamped = weights.clamp(min=low, max=threshold)
    if mask.sum() > 1:
        spread = _verl_mean(clamped.square(), mask) - _verl_mean(clamped, mask).square()
        found["rollout_is_std"] = float(spread.clamp(min=0.0).sqrt())
    else:
        found["rollout_is_std"] = 0.0
    normalized = clamped / (_verl_mean(clamped, mask) + EPSILON)
    found["rollout_is_eff_sample_size"] = float(1.0 / _verl_mean(normalized.square(), mask))
    per_sequence = _verl_mean(weights, mask, axis=-1)
    found.update(rollout_is_seq_mean=float(per_sequence.mean()),
                 rollout_is_seq_std=float(per_sequence.std()) if per_sequence.numel() > 1 else 0.0,
                 rollout_is_seq_max=float(per_sequence.max()), rollout_is_seq_min=float(per_sequence.min()),
                 rollout_is_seq_max_deviation=float((per_sequence - 1.0).abs().max()),
                 rollout_is_seq_fraction_high=float((per_sequence > threshold).double().mean()),
                 rollout_is_seq_fraction_low=float((per_sequence < low).double().mean()))
    return found


def verl(log_pi: torch.Tensor, log_mu: torch.Tensor, mask: torch.Tensor, rollout_is: str | None = None,
         threshold: float | None = None) -> dict:
    """Every `rollout_corr/` metric verl logs for one batch with `algorithm.rollout_correction` at its defaults
    (sequence-level weights, threshold 2) and no rejection sampling or veto (their metrics are left out)."""
    rollout_is = VERL_DEFAULTS["rollout_is"] if rollout_is is None else rollout_is
    threshold = VERL_DEFAULTS["rollout_is_threshold"] if threshold is None else threshold
    found = {**verl_weights(log_pi, log_mu, mask, rollout_is, threshold), **verl_offpolicy(log_pi, log_mu, mask)}
    return {f"rollout_corr/{name}": value for name, value in found.items()}


def _nemo_kl(logprobs: torch.Tensor, reference: torch.Tensor, kl_type: str) -> torch.Tensor:
    """NeMo-RL's `calculate_kl` without clamps (as the loss calls it here), log r = reference − logprobs."""
    log_r = reference - logprobs
    if kl_type == "k1":
        return -log_r
    if kl_type == "k2":
        return log_r.square() / 2
    if kl_type == "k3":
        return torch.exp(log_r) - 1 - log_r
    raise ValueError(f"kl_type={kl_type!r} is not one of NeMo-RL's KL estimators; choose k1, k2 or k3.")


def nemo_rl(log_pi: torch.Tensor, log_mu: torch.Tensor, mask: torch.Tensor, kl_type: str | None = None) -> dict:
    """NeMo-RL's ClippedPGLossFn mismatch metrics for one global batch: the mean of exp(|log π − log μ|)
    over real tokens, KL[μ‖π] (`gen_kl_error`) and KL[π‖μ] (`policy_kl_error`) by `reference_policy_kl_type`
    (k3 by default), a Jensen–Shannon estimate, and the mean token weight π/μ at the default configuration
    (token-level, no truncation). Its inputs are already aligned to the completion (NeMo-RL slices [:, 1:])."""
    log_pi, log_mu, mask = _inputs(log_pi, log_mu, mask)
    kl_type = NEMO_DEFAULTS["reference_policy_kl_type"] if kl_type is None else kl_type
    count = mask.sum()

    def mean(values):  # NeMo-RL's masked_mean with the batch's token count as its global normaliser
        return float((values * mask).sum() / (count + EPSILON))

    mixture = torch.log(0.5 * torch.exp(log_pi) + 0.5 * torch.exp(log_mu))
    to_mixture = {name: torch.exp(lp - mixture) - (lp - mixture) - 1 for name, lp in (("pi", log_pi), ("mu", log_mu))}
    weights = torch.nan_to_num(torch.exp(log_pi - log_mu), nan=0.0, posinf=0.0, neginf=0.0)
    return {"train/token_mult_prob_error": mean(torch.exp((log_mu - log_pi).abs() * mask)),
            "train/gen_kl_error": mean(_nemo_kl(log_mu, log_pi, kl_type)),
            "train/policy_kl_error": mean(_nemo_kl(log_pi, log_mu, kl_type)),
            "train/js_divergence_error": mean(0.5 * to_mixture["pi"] + 0.5 * to_mixture["mu"]),
            "train/sampling_importance_ratio": mean(weights)}


def measure(log_pi: torch.Tensor, log_mu: torch.Tensor, mask: torch.Tensor) -> dict[str, dict[str, float]]:
    """Each framework's mismatch metrics for one batch at its defaults, keyed by framework, then metric name."""
    return {"trl": trl(log_pi, log_mu, mask), "verl": verl(log_pi, log_mu, mask),
            "NeMo-RL": nemo_rl(log_pi, log_mu, mask)}
