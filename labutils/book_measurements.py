"""The book's own measurements of the real model's sampler–trainer mismatch, to hold a new one against.

They are read at run time, never typed in: from the committed real-model RL run (results/long/real_rl.json,
its probe before training), the committed cross-engine run (results/long/04c_cross_engine.json) and, where this checkout has built the book on a CPU, from chapters 4b and 5b's
results (_build/results). Each comes with a 95% interval and the set-up it was measured in. They are
measurements of SmolLM2-135M-Instruct at temperature 1 on the CPUs they name; another model, another
temperature or another device's kernels can land elsewhere without anything being wrong.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from . import clusters, pretrained

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "_build" / "results"
COMMITTED_RL = ROOT / "results" / "long" / "real_rl.json"
DIAL_KEY = {"fp8": "fp8_e4m3", "fp8_channel": "fp8_e4m3_channel"}  # chapter 5b's metric names of dial settings


@dataclass(frozen=True)
class Reference:
    """One measurement by the book: its value, 95% interval, and where and how it was measured."""

    value: float
    low: float
    high: float
    where: str
    device: str  # the CPU and its kernel set: bf16 and fp16 arithmetic can differ between kernel sets


def _build_metrics(chapter: str) -> tuple[dict, str, str] | None:
    """A chapter's metrics from this checkout's CPU build of the book, its profile and its CPU; None where absent."""
    path = BUILD / f"{chapter}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("profile") != "cpu":  # a test or GPU-path build measures the toy, or on other kernels
        return None
    env = data.get("env", {})
    return data.get("metrics", {}), data["profile"], device(env.get("cpu", "?"), env.get("kernels", "?"))


def device(cpu: str, kernels: str) -> str:
    """A CPU and its kernel set in one string, as a reference records it."""
    return f"{cpu}; {kernels}"


def _interval(value: float, stderr: float, sequences: int) -> tuple[float, float]:
    """A t interval over `sequences`, or value ± 2 standard errors where the count is unknown."""
    if sequences >= 2:
        return clusters.interval(value, stderr, sequences)
    return value - 2 * stderr, value + 2 * stderr


def _chapter_4b(quantity: str, sampler: str, trainer: str, mode: str) -> list[Reference]:
    """Chapter 4b's offline measurement: both engines pure in one dtype (and an fp32 sampler, bf16 trainer)."""
    found = _build_metrics("04b_real_mismatch")
    if found is None or found[0].get("real.model") != pretrained.DESCRIPTION:
        return []
    m, _, cpu = found
    if mode != "pure" and trainer != "fp32":
        return []
    if sampler == "fp32" and trainer == "bf16" and quantity == "token_kl":
        key = "bf16_train_fp32_infer"
        n = int(m.get(f"real.{key}_sequences", 0))
        tokens = int(m.get(f"real.{key}_tokens", 0)) // max(1, n)
        value, se = m[f"real.token_kl.{key}"], m[f"real.token_kl_stderr.{key}"]
        return [Reference(value, *_interval(value, se, n),
                          f"chapter 4b (the book's CPU build), fp32 sampler against a pure bf16 trainer, {n} chat "
                          f"requests × {tokens} tokens", cpu)]
    if sampler != trainer or f"real.token_kl.{sampler}" not in m:
        return []
    p = sampler
    n_all = int(m[f"real.sequences.{p}"])
    setup = f"chapter 4b (the book's CPU build), both engines pure {p}"
    per_sequence = f"× {int(m[f'real.tokens.{p}']) // n_all} tokens"
    if quantity == "token_kl":
        n = int(m[f"real.exact_sequences.{p}"])
        found = m[f"real.token_kl.{p}"], m[f"real.token_kl_stderr.{p}"], n, f"{n} chat requests {per_sequence}"
    elif quantity == "k3":
        found = m[f"real.k3.{p}"], m[f"real.k3_stderr.{p}"], n_all, f"{n_all} chat requests {per_sequence}"
    elif quantity == "drift_per_1k":
        found = (m[f"real.slope_per_1k.{p}"], m[f"real.slope_stderr_per_1k.{p}"], n_all,
                 f"{n_all} chat requests {per_sequence}")
    elif quantity.startswith("prefix_sd.") and p == "bf16" and f"real.{quantity}.measured" in m:
        draws = int(m.get("real.prefix_sd_sequences", n_all))  # its own chi-square interval, as recorded
        return [Reference(m[f"real.{quantity}.measured"], m[f"real.{quantity}.low"], m[f"real.{quantity}.high"],
                          f"{setup}, {draws} chat requests", cpu)]
    elif (quantity.startswith("trl_default_weight.")
          and f"real.trl_is.{p}.{quantity.removeprefix('trl_default_weight.')}.mean" in m):
        key = f"real.trl_is.{p}.{quantity.removeprefix('trl_default_weight.')}"  # then the trl mode and the length
        found = m[f"{key}.mean"], m[f"{key}.se"], n_all, f"{n_all} chat requests"
    else:
        return []
    value, se, n, drawn = found
    return [Reference(value, *_interval(value, se, n), f"{setup}, {drawn}", cpu)]


def _chapter_5b(quantity: str, sampler: str, trainer: str) -> list[Reference]:
    """Chapter 5b's real-model dial: each sampler setting against the fp32 trainer, exact token KL."""
    found = _build_metrics("05b_sampler_precision")
    if found is None or quantity != "token_kl" or trainer != "fp32":
        return []
    from .profiles import PROFILES

    m, profile, cpu = found
    key = DIAL_KEY.get(sampler, sampler.removeprefix("m") if sampler.startswith("m") else sampler)
    if f"real.dial.{key}.token_kl" not in m:
        return []
    plan = PROFILES[profile].real
    value, se = m[f"real.dial.{key}.token_kl"], m[f"real.dial.{key}.seq_kl_1k_stderr"] / 1000
    return [Reference(value, *_interval(value, se, plan.dial_sequences),
                      f"chapter 5b (the book's CPU build), {sampler} sampler against the fp32 trainer, "
                      f"{plan.dial_sequences} chat requests × {plan.dial_length} tokens", cpu)]


def _cross_engine(quantity: str, sampler: str, trainer: str, mode: str, tokens: int | None) -> list[Reference]:
    """Chapter 4c's committed run: llama.cpp's GGUF types and the torch samplers against a pure torch trainer, read
    over the first `tokens` positions (whole blocks) where a run was shorter: some of its pairs grow along the
    sequence."""
    from . import cross_engine, engine_table

    if mode != "pure" and trainer != "fp32":
        return []
    run, stale = cross_engine.load()
    name = engine_table.pair_name(sampler if sampler.startswith("llama.cpp:") else f"torch:{sampler}",
                                  f"torch:{trainer}")
    if run is None or stale or name not in run["pairs"]:
        return []
    plan, made = run["plan"], run["provenance"]
    kept = plan["tokens"] if tokens is None else max(plan["block"], min(plan["tokens"], tokens) // plan["block"]
                                                         * plan["block"])
    blocks = kept // plan["block"]
    pair = {k: [row[:blocks] for row in v] for k, v in run["pairs"][name].items() if k.endswith("_blocks")}
    s = engine_table.summary(pair, {**plan, "tokens": kept})
    where = (f"chapter 4c's committed run, {sampler} sampler against a torch trainer "
             f"{'in fp32' if trainer == 'fp32' else 'cast whole to ' + trainer}, "
             f"{s['sequences']} chat requests, their first {kept} tokens")
    cpu = device(made.get("cpu", "?"), made.get("kernel_set", "?"))
    if quantity == "token_kl":
        return [Reference(s["token_kl"], s["low"], s["high"], where, cpu)]
    if quantity == "drift_per_1k":
        return [Reference(s["drift_per_1k"], *_interval(s["drift_per_1k"], s["drift_stderr"], s["sequences"]), where, cpu)]
    n = int(quantity.split(".")[1]) if quantity.startswith("prefix_sd.") else None
    if n in s["spread"]:
        sd = s["spread"][n]
        return [Reference(sd["sd"], sd["low"], sd["high"], where, cpu)]
    return []


def _committed_rl(quantity: str, sampler: str, trainer: str, mode: str) -> list[Reference]:
    """Chapter 5's committed GRPO run: its probe's exact token KL before training, sampler pure, trainer autocast."""
    if quantity != "token_kl" or sampler != trainer or (mode != "autocast" and trainer != "fp32"):
        return []
    try:
        payload = json.loads(COMMITTED_RL.read_text())
    except (OSError, ValueError):
        return []
    if not str(payload.get("provenance", {}).get("model", "")).startswith(pretrained.NAME):
        return []
    runs = payload.get("runs", {}).get(f"{sampler}_{trainer}")
    if not runs:
        return []
    plan, made = payload["chosen"], payload["provenance"]
    # each probe prompt's value before training, averaged over the seeds (which share their prompts)
    start = [sum(values) / len(values) for values in zip(*(r["probe_mismatch"][0] for r in runs))]
    draws = len(start)
    value = sum(start) / draws
    se = (sum((v - value) ** 2 for v in start) / (draws - 1) / draws) ** 0.5
    return [Reference(value, *_interval(value, se, draws),
                      f"chapter 5's committed GRPO run before training, {sampler} sampler, "
                      f"{'fp32' if trainer == 'fp32' else trainer + ' autocast'} trainer, "
                      f"{plan['probe_sequences']} 'Repeat this number' requests × up to {plan['max_new_tokens']} "
                      "tokens", device(made.get("cpu", "?"), made.get("kernel_set", "?")))]


def references(quantity: str, sampler: str, trainer: str, mode: str, tokens: int | None = None) -> list[Reference]:
    """The book's measurements of `quantity` on the real model in this set-up (sampler dial name, trainer dtype,
    trainer mode `pure` or `autocast`); empty where the book has none."""
    return [*_chapter_4b(quantity, sampler, trainer, mode), *_chapter_5b(quantity, sampler, trainer),
            *_committed_rl(quantity, sampler, trainer, mode), *_cross_engine(quantity, sampler, trainer, mode, tokens)]


def verdict(value: float, low: float, high: float, found: list[Reference], why_none: str = "") -> str:
    """One line: whether the measured 95% interval [low, high] overlaps the book's intervals, lies above or below."""
    if not found:
        return why_none or "the book has not measured this set-up on its real model; no range to compare with"
    scale = max(abs(value), *(abs(r.value) for r in found))
    if high - low > 4 * scale:  # an interval wider than anything it could be told apart from
        return (f"too uncertain to compare (95% interval {low:.2g} – {high:.2g}, the book's "
                f"{min(r.value for r in found):.3g}): run more --sequences")
    floor, ceiling = min(r.low for r in found), max(r.high for r in found)
    values = sorted(r.value for r in found)
    shown = f"{values[0]:.3g}" if len(values) == 1 else f"{values[0]:.3g} – {values[-1]:.3g}"
    if high < floor:
        word = "below"
        factor = values[0] / value if value > 0 and values[0] > 0 else math.nan
    elif low > ceiling:
        word = "above"
        factor = value / values[-1] if value > 0 and values[-1] > 0 else math.nan
    else:
        return f"in line with the book's {shown} (95% intervals overlap)"
    times = f" ({factor:.2g}× {'under' if word == 'below' else 'over'} it)" if math.isfinite(factor) else ""
    return f"{word} the book's {shown}{times}, beyond both 95% intervals"
