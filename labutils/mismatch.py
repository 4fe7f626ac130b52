"""How far the training engine's π is from the inference engine's μ, on tokens μ sampled.

With samples from μ and r = π/μ on each sampled token, the three classic estimators of the
token-level KL[μ‖π] are (Schulman's k1, k2, k3):

    k1 = -log r            unbiased, noisy, can be negative
    k2 = (log r)^2 / 2     biased, low variance, always >= 0
    k3 = (r - 1) - log r   unbiased and always >= 0

With both distributions over the whole vocabulary the token KL is exact: Σ_v μ_v (log μ_v - log π_v).
Summed over a sequence, log π(y) - log μ(y) = Σ_t log r_t is the sequence log-ratio. Its mean is
minus the sequence-level KL[μ‖π], so it drifts down linearly with length: the fitted slope is a
mean per token, not a variance. The importance weight w = π(y)/μ(y) built from it behaves
differently: E_μ[w] = 1 exactly at every length, its variance is Π_t (1 + χ²_t) - 1 ≈ (1 + χ²)^n - 1
(exponential in n), and its median falls like exp(-n·KL).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def log_ratio(train_logprobs: torch.Tensor, infer_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token log π - log μ, zero where `mask` is off."""
    return (train_logprobs - infer_logprobs) * mask


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    count = mask.sum()
    if count == 0:
        raise ValueError("the mask selects no tokens; there is nothing to average.")
    return float((values * mask).sum() / count)


def stderr(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Standard error of the mean of `values` over real tokens: sample std / √count, tokens taken as independent."""
    kept = values.double()[mask.bool()]
    if kept.numel() < 2:
        raise ValueError("a standard error needs at least two real tokens.")
    return float(kept.std() / kept.numel() ** 0.5)


def _k3_values(ratio_log: torch.Tensor) -> torch.Tensor:
    lr = ratio_log.double()  # float64, so tiny values do not cancel to zero
    return torch.expm1(lr) - lr


def k1(ratio_log: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of -log r over real tokens."""
    return _masked_mean(-ratio_log, mask)


def k1_stderr(ratio_log: torch.Tensor, mask: torch.Tensor) -> float:
    """Standard error of k1: how far the sampled tokens alone can pin the KL down."""
    return stderr(-ratio_log, mask)


def k2(ratio_log: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of (log r)^2 / 2 over real tokens."""
    return _masked_mean(ratio_log.square() / 2, mask)


def k3(ratio_log: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of (r - 1) - log r over real tokens (float64, so tiny values do not cancel to zero)."""
    return _masked_mean(_k3_values(ratio_log), mask.double())


def k3_stderr(ratio_log: torch.Tensor, mask: torch.Tensor) -> float:
    """Standard error of k3."""
    return stderr(_k3_values(ratio_log), mask)


def token_kl(infer_vocab: torch.Tensor, train_vocab: torch.Tensor) -> torch.Tensor:
    """Exact KL[μ‖π] at every position from full-vocabulary log-probabilities [..., V] -> [...].

    Entries μ gives zero probability (a banned token: log μ = -inf) contribute nothing.
    """
    flat_mu, flat_pi = infer_vocab.reshape(-1, infer_vocab.shape[-1]), train_vocab.reshape(-1, train_vocab.shape[-1])
    out = torch.empty(flat_mu.shape[0], dtype=torch.float64)
    for start in range(0, flat_mu.shape[0], 256):  # in float64, 256 positions at a time: 100 MB, not GBs
        log_mu = flat_mu[start:start + 256].double()
        mu = log_mu.exp()
        gap = (log_mu - flat_pi[start:start + 256].double()).masked_fill(mu == 0, 0.0)
        out[start:start + 256] = (mu * gap).sum(-1)
    return out.reshape(infer_vocab.shape[:-1])


def token_chi2(infer_vocab: torch.Tensor, train_vocab: torch.Tensor) -> torch.Tensor:
    """Exact χ²(π‖μ) = Σ_v μ_v (π_v/μ_v - 1)² = E_μ[r²] - 1 at every position, [..., V] -> [...].

    The importance weight's second moment per token; entries μ gives zero probability contribute nothing.
    """
    mu = infer_vocab.double().exp()
    gap = (train_vocab.double() - infer_vocab.double()).masked_fill(mu == 0, 0.0)
    return (mu * torch.expm1(gap).square()).sum(-1)


def sequence_log_ratio(ratio_log: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t (log π - log μ) per sequence."""
    return (ratio_log * mask).sum(-1)


@dataclass(frozen=True)
class LengthFit:
    """Least-squares line of a per-sequence value against length, the slope per 1,000 tokens."""

    slope_per_1k: float
    stderr_per_1k: float  # standard error of the slope: how much of it is noise
    intercept: float
    r2: float


def length_fit(lengths: torch.Tensor, values: torch.Tensor) -> LengthFit:
    """Fit values = intercept + slope * length; needs at least two distinct lengths."""
    x, y = lengths.double(), values.double()
    if x.numel() < 2 or bool((x == x[0]).all()):
        raise ValueError("a length fit needs sequences of at least two different lengths.")
    xc, yc = x - x.mean(), y - y.mean()
    slope = float((xc * yc).sum() / xc.square().sum())
    intercept = float(y.mean() - slope * x.mean())
    total = float(yc.square().sum())
    residual = float((y - intercept - slope * x).square().sum())
    stderr = (residual / max(1, x.numel() - 2) / float(xc.square().sum())) ** 0.5
    return LengthFit(slope * 1000, stderr * 1000, intercept, 1 - residual / total if total > 0 else 1.0)


def by_length(lengths: torch.Tensor, values: torch.Tensor, edges: list[int]) -> list[dict]:
    """Count, mean and standard deviation of `values` in each length bucket [edges[i], edges[i+1])."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (lengths >= lo) & (lengths < hi)
        chunk = values[inside].double()
        rows.append({"from": lo, "to": hi, "count": int(inside.sum()),
                     "mean": float(chunk.mean()) if chunk.numel() else float("nan"),
                     "std": float(chunk.std()) if chunk.numel() > 1 else float("nan")})
    return rows


def importance_weights_by_length(lengths: torch.Tensor, seq_log_ratio: torch.Tensor, edges: list[int],
                                 token_kl: float, token_chi2: float) -> list[dict]:
    """The weight w = exp(seq_log_ratio) per length bucket [edges[i], edges[i+1]), beside its predictions.

    Measured: count, mean length n̄, mean w and its standard error, variance and median of w.
    Predicted for independent tokens: median exp(-n̄·KL), variance (1 + χ²)^n̄ - 1 (the mean is 1).
    """
    weights, lengths = seq_log_ratio.double().exp(), lengths.double()
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (lengths >= lo) & (lengths < hi)
        w, count = weights[inside], int(inside.sum())
        n = float(lengths[inside].mean()) if count else float("nan")
        variance = float(w.var()) if count > 1 else float("nan")
        rows.append({"from": lo, "to": hi, "count": count, "mean_length": n,
                     "mean": float(w.mean()) if count else float("nan"),
                     "mean_stderr": (variance / count) ** 0.5 if count > 1 else float("nan"),
                     "variance": variance, "median": float(w.quantile(0.5)) if count else float("nan"),
                     "predicted_median": float(torch.tensor(-n * token_kl, dtype=torch.float64).exp()),
                     "predicted_variance": float(torch.tensor(token_chi2, dtype=torch.float64).log1p().mul(n).expm1())})
    return rows


def by_position(per_token: torch.Tensor, mask: torch.Tensor, edges: list[int]) -> list[float]:
    """Mean of a per-token value over real tokens at positions [edges[i], edges[i+1]) of the completion."""
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = mask[:, lo:hi]
        out.append(float((per_token[:, lo:hi] * inside).sum() / inside.sum()) if inside.any() else float("nan"))
    return out


def summary(rollout, train_logprobs: torch.Tensor, train_vocab: torch.Tensor | None = None) -> dict:
    """Every measure of one (μ, π) pair: token estimators and their standard errors, exact KL and χ²,
    sequence log-ratios, length fit."""
    mask = rollout.mask
    lr = log_ratio(train_logprobs, rollout.logprobs, mask)
    seq = sequence_log_ratio(lr, mask)
    lengths = rollout.lengths
    out = {"k1": k1(lr, mask), "k2": k2(lr, mask), "k3": k3(lr, mask),
           "k1_stderr": k1_stderr(lr, mask), "k3_stderr": k3_stderr(lr, mask),
           "max_abs_token_log_ratio": float(lr.abs().max()),
           "seq_log_ratio_mean": float(seq.mean()), "seq_log_ratio_std": float(seq.std()),
           "tokens": int(mask.sum())}
    if train_vocab is not None and rollout.vocab_logprobs is not None:
        per_token = token_kl(rollout.vocab_logprobs, train_vocab) * mask
        out["token_kl"] = float(per_token.sum() / mask.sum())
        out["kl"] = float(per_token.sum(-1).mean())  # sequence-level KL[μ‖π], averaged over sequences
        out["token_chi2"] = float((token_chi2(rollout.vocab_logprobs, train_vocab) * mask).sum() / mask.sum())
    if not bool((lengths == lengths[0]).all()):
        fit = length_fit(lengths, seq)
        out.update(slope_per_1k=fit.slope_per_1k, slope_stderr_per_1k=fit.stderr_per_1k,
                   intercept=fit.intercept, r2=fit.r2)
    return out


@dataclass
class TokenRecord:
    """One engine pair's view of the same sampled tokens, per sequence and position ([N, L] tensors).

    `log_mu` and `log_pi` are the sampled tokens' log-probabilities under the inference and the
    training engine; `mask` marks real tokens; `kl` is the exact token KL[μ‖π] over the whole
    vocabulary, for the first `kl.shape[0]` sequences only (those whose full distributions were kept).
    """

    log_mu: torch.Tensor
    log_pi: torch.Tensor
    mask: torch.Tensor
    kl: torch.Tensor
    seconds: float  # sampling time

    @property
    def log_ratio(self) -> torch.Tensor:
        return log_ratio(self.log_pi, self.log_mu, self.mask)

    @property
    def kl_mask(self) -> torch.Tensor:
        """The real tokens of the sequences that have an exact KL."""
        return self.mask[: self.kl.shape[0]]


def measure(sampler, scorer, prompts: list[list[int]], length: int, seed: int, chunk: int,
            exact: int | None = None, temperature: float = 1.0) -> TokenRecord:
    """Sample `length` tokens per prompt (EOS banned) and rescore them, `chunk` prompts at a time.

    The exact token KL needs both engines' full distributions (a 49K vocabulary is 196 KB per token and
    engine): they are kept for the first `exact` sequences only (all when None), one micro-batch of log π
    at a time, and freed once the KL is taken. Every sequence gives log μ and log π of its sampled tokens.
    """
    exact = len(prompts) if exact is None else exact
    generator = torch.Generator(sampler.device).manual_seed(seed)
    sampled, kls, seconds = [], [], 0.0
    for start in range(0, len(prompts), chunk):
        kept = max(0, min(chunk, exact - start))
        rollout = sampler.sample(prompts[start:start + chunk], length, length, temperature=temperature,
                                 keep_vocab=kept, generator=generator)
        seconds += rollout.seconds
        for first in range(0, len(rollout.prompt_ids), scorer.micro_batch):
            some = rollout.rows(first, first + scorer.micro_batch)
            full = first < kept  # the micro-batch holds sequences with log μ of the whole vocabulary
            scored = scorer.score(some, temperature=temperature, keep_vocab=full)
            sampled.append((some.logprobs, scored.logprobs, some.mask))
            if full:
                rows = min(len(some.prompt_ids), kept - first)
                kls.append(token_kl(some.vocab_logprobs[:rows], scored.vocab[:rows]) * some.mask[:rows])
            del scored
        del rollout
    log_mu, log_pi, mask = (torch.cat(column) for column in zip(*sampled))
    kl = torch.cat(kls) if kls else torch.zeros(0, mask.shape[1], dtype=torch.float64)
    return TokenRecord(log_mu, log_pi, mask, kl, seconds)


def block_mean(values: torch.Tensor, mask: torch.Tensor, block: int = 128) -> tuple[float, float]:
    """Mean of a per-token value over real tokens, and its standard error from means of `block`-token runs.

    Neighbouring tokens share a context, so their errors are not independent; the means of long runs of
    tokens nearly are (batch means). Needs at least two blocks.
    """
    sums, counts = [], []
    for row, real in zip(values.double(), mask.bool()):
        kept = row[real]
        for start in range(0, kept.numel() - block + 1, block):
            sums.append(float(kept[start:start + block].sum()))
            counts.append(block)
    if len(sums) < 2:
        raise ValueError(f"a block standard error needs at least two runs of {block} tokens.")
    means = torch.tensor(sums, dtype=torch.float64) / torch.tensor(counts, dtype=torch.float64)
    return float(means.mean()), float(means.std() / len(sums) ** 0.5)


def prefix_slope(ratio_log: torch.Tensor, mask: torch.Tensor, step: int = 64, window: int = 256) -> tuple[float, float]:
    """Slope of the prefix log-ratio log π(y≤n)/μ(y≤n) against n, per 1K tokens, and its standard error.

    Each run of `window` tokens of each sequence gives one least-squares slope of its running log-ratio
    against n = step, 2·step, … window; every run has the same prefixes, so the pooled fit's slope is their
    mean, and its standard error is their spread over √runs. Runs far apart share little context, so they
    are nearly independent, unlike the prefixes of one run. Needs at least two runs.
    """
    lengths = mask.sum(-1)
    if bool((lengths != lengths[0]).any()):
        raise ValueError("prefix_slope needs sequences of one length.")
    window = min(window, int(lengths[0]))
    grid = torch.arange(step, window + 1, step)
    runs = ratio_log.double()[:, : int(lengths[0]) // window * window].reshape(-1, window)
    if runs.shape[0] < 2 or grid.numel() < 2:
        raise ValueError(f"prefix_slope needs at least two runs of {window} tokens and two prefixes of {step}.")
    prefixes = runs.cumsum(-1)[:, grid - 1]
    slopes = torch.tensor([length_fit(grid, row).slope_per_1k for row in prefixes], dtype=torch.float64)
    return float(slopes.mean()), float(slopes.std() / slopes.numel() ** 0.5)


def by_probability(per_token: torch.Tensor, probability: torch.Tensor, mask: torch.Tensor,
                   edges: list[float]) -> list[dict]:
    """Count, mean and standard error of a per-token value by the probability bucket [edges[i], edges[i+1])."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = mask.bool() & (probability >= lo) & ((probability < hi) if hi < 1 else (probability <= hi))
        chunk = per_token[inside].double()
        rows.append({"from": lo, "to": hi, "count": int(inside.sum()),
                     "mean": float(chunk.mean()) if chunk.numel() else float("nan"),
                     "stderr": float(chunk.std() / chunk.numel() ** 0.5) if chunk.numel() > 1 else float("nan")})
    return rows


def paired_ratio(kl_a: torch.Tensor, mask_a: torch.Tensor, kl_b: torch.Tensor, mask_b: torch.Tensor,
                 confidence: float = 0.95) -> tuple[float, float, float]:
    """Ratio of two token KLs measured on the same prompts (row i of each), with a t interval over the prompts.

    Each prompt gives log(mean KL_a / mean KL_b); their mean and spread over the prompts set the ratio and its
    interval, so a prompt that is hard for both precisions does not count as evidence. Needs two prompts.
    """
    from scipy import stats

    rows = min(kl_a.shape[0], kl_b.shape[0])
    if rows < 2:
        raise ValueError("a paired ratio needs at least two prompts measured in both precisions.")
    per_a = (kl_a[:rows] * mask_a[:rows]).sum(-1) / mask_a[:rows].sum(-1)
    per_b = (kl_b[:rows] * mask_b[:rows]).sum(-1) / mask_b[:rows].sum(-1)
    logs = (per_a / per_b).double().log()
    half = float(stats.t.ppf(0.5 + confidence / 2, rows - 1) * logs.std() / rows ** 0.5)
    centre = float(logs.mean())
    return math.exp(centre), math.exp(centre - half), math.exp(centre + half)
