"""The findings page: what the book found and what to do, by situation, with each situation's evidence.

Generated at build time from `_build/results/*.json`, like the claims ledger: each number is this
build's, and each comparative word ("more than", "accumulates", "inconclusive") is chosen by a function
of the number and its interval that decides it. Where a chapter records a real-model metric
(`real.`-prefixed) for the same quantity as a toy one, the page reads the real one; a toy number is shown
only beside it, labelled (`Reader.toy`). The causal chain figure marks each link from the chapters' own
conclusions, the decision figure leads from a reader's stack to the situation cards, and the log section
reads the metric names trl logs from the installed trl.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Callable

from labutils.results import load_all
from . import ledger, quantities
from .status import table

SHOWN, MECHANISM, NOT_SHOWN, INCONCLUSIVE = ("shown here", "mechanism only", "not shown (needs a GPU)",
                                             "inconclusive")
AGAINST_HERE = "contradicted here"
BADGES = {SHOWN: "success", MECHANISM: "info", NOT_SHOWN: "secondary", INCONCLUSIVE: "warning", AGAINST_HERE: "danger"}
FIGURES = "findings"  # the figures' folder beside the page
MISSING = "not measured in this build"
CODE_WIDTH = 76  # a config block's longest line: within the house's 88, and it fits the card at 1,280 px

PAPER = "[Qi et al. 2025, *Defeating the Training-Inference Mismatch via FP16*](https://arxiv.org/abs/2510.26788)"
PAPER_SHORT = "[Qi et al. 2025](https://arxiv.org/abs/2510.26788)"
PRECISION_RL = "[Precision-RL](https://github.com/sail-sg/Precision-RL)"
TIS = "[Yao et al. 2025's truncated importance sampling (TIS)](https://fengyao.notion.site/off-policy-rl)"
DEEPSEEK_V3 = "[DeepSeek-V3's technical report, §3.3](https://arxiv.org/abs/2412.19437)"
FRAMEWORKS = {"trl": "https://github.com/huggingface/trl", "verl": "https://github.com/volcengine/verl",
              "accelerate": "https://github.com/huggingface/accelerate",
              "DeepSpeed": "https://github.com/deepspeedai/DeepSpeed", "vLLM": "https://github.com/vllm-project/vllm",
              "peft": "https://github.com/huggingface/peft", "NeMo-RL": "https://github.com/NVIDIA-NeMo/RL"}
# the other frameworks' metric sources, as read for this page (the installed trl is read at build time)
VERL_METRICS = ("https://github.com/volcengine/verl/blob/0b4e2a814129c07f016787cbce476132ceb6c5cb/"
                "verl/trainer/ppo/rollout_corr_helper.py", "verl/trainer/ppo/rollout_corr_helper.py")
NEMO_METRICS = ("https://github.com/NVIDIA-NeMo/RL/blob/005a098a5fc04317a0ceb792e66a8b8076804618/"
                "nemo_rl/algorithms/loss_functions.py", "nemo_rl/algorithms/loss_functions.py")


# --- reading this build's results: the real model's number wherever a chapter records one ---------------

class ToyWhereReal(Exception):
    """The page read a toy metric where the chapter records a real-model one for the same quantity."""


# a toy metric's real-model counterpart: the same key under `real.`, or one of another name (quantities.REAL_OF)
real_counterpart = quantities.real_counterpart


def _metric(runs: dict):
    """A reader of `chapter:key` from this build's results (KeyError where the chapter or key is missing)."""
    def read(ref: str):
        chapter, key = ref.split(":", 1)
        value = runs[chapter]["metrics"][key]
        return float(value) if value in ("nan", "inf", "-inf") else value
    return read


class Reader:
    """Reads `chapter:key` from this build's results (KeyError where the chapter or key is missing).

    Calling it with a toy key whose real-model counterpart is recorded raises ToyWhereReal: the page
    shows the real number, and the toy's only through `toy()`, which the page labels."""

    def __init__(self, runs: dict):
        self.runs, self.read, self.read_toy = runs, set(), set()
        self._value, self._toy_value = _metric(runs), _metric(runs)

    def __call__(self, ref: str):
        real = real_counterpart(ref, self.runs)
        if real is not None:
            raise ToyWhereReal(f"the findings page reads the toy's {ref} where this build records {real}: "
                               "read the real one, and show the toy's beside it with Reader.toy")
        self.read.add(ref)
        return self._value(ref)

    def toy(self, ref: str):
        """A toy number, for showing beside the real one with a 'toy' label."""
        self.read_toy.add(ref)
        return self._toy_value(ref)

    def has(self, ref: str) -> bool:
        chapter, key = ref.split(":", 1)
        return key in self.runs.get(chapter, {}).get("metrics", {})


# --- words chosen by the numbers -------------------------------------------------------------------------

def comparative(low: float, high: float, more: str = "more", less: str = "less") -> str:
    """How a ratio A/B with 95% interval [low, high] compares A with B, in words: 'far more than' only
    beyond 10×, 'about the same as' where the interval includes 1 (`more`/`less`: 'larger'/'smaller')."""
    if low > 10:
        return f"far {more} than"
    if low > 2:
        return f"{more} than"
    if low > 1:
        return f"a little {more} than"
    if high < 0.1:
        return f"far {less} than"
    if high < 1:
        return f"{less} than"
    return "about the same as"


def _pct(x: float) -> str:
    """A share as a percentage that is never rounded to 0.0% when it is not zero (0.01%, 0.75%, 12.3%)."""
    if x == 0:
        return "0%"
    if abs(x) < 0.01:
        return f"{100 * x:.2g}%"
    return f"{x:.1%}"


def _sci(x: float) -> str:
    """A small positive number as 2.5e-3 (not 0.0025 or 2.5e-03)."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _ci(value: float, low: float, high: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}× (95% interval {low:.{digits}f}–{high:.{digits}f})"


# --- the situations ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Context:
    """What a situation's sentences may read: this build's metrics, the chain's links, installed defaults."""
    read: Reader
    links: dict[str, str]  # link key -> status
    defaults: dict[str, str]
    root: Path


@dataclass(frozen=True)
class Evidence:
    chapter: str
    section: str  # the heading that measured it, as the reader sees it
    kind: str | Callable[[Reader], str]  # SHOWN, MECHANISM, NOT_SHOWN or INCONCLUSIVE, or a function of the numbers
    numbers: Callable[[Reader], str]  # metric reader -> a short sentence with this build's numbers


@dataclass(frozen=True)
class Config:
    tool: str
    code: str | Callable[[Context], str]  # a copy-paste block, at most CODE_WIDTH characters a line
    lang: str = "python"
    note: str = ""  # one sentence under the block


@dataclass(frozen=True)
class Finding:
    key: str  # the card's label, findings-<key>
    situation: str
    do: str | Callable[[Context], str]
    configs: tuple[Config, ...]
    evidence: tuple[Evidence, ...] = field(default_factory=tuple)


def _during_rl(m) -> str:
    """Chapter 5's committed real-model run: each 16-bit pair's probe mismatch at its start and end."""
    def pair(name):
        key = f"05_grpo_precision:real.rl.long.{name}"
        seeds = m(f"{key}.seeds")
        return (f"{_sci(m(f'{key}.probe_kl_start'))} → {_sci(m(f'{key}.probe_kl_end'))} nats per token "
                f"({m(f'{key}.verdict')}; {seeds} seed{'s' * (seeds > 1)})")
    return (f"SmolLM2-135M trained by trl GRPO on a CPU for {m('05_grpo_precision:real.rl.long.steps')} steps "
            f"(lr {m('05_grpo_precision:real.rl.long.lr'):g}): the mismatch on fixed prompts went bf16 "
            f"{pair('bf16_bf16')}, fp16 {pair('fp16_fp16')}, while held-out accuracy went "
            f"{m('05_grpo_precision:real.rl.long.fp32_fp32.eval_start'):.2f} → "
            f"{m('05_grpo_precision:real.rl.long.fp32_fp32.eval_end'):.2f} in the fp32 control")


def _trl_length_penalty(m) -> str:
    """Chapter 4b: trl's default sequence-level correction weighs long bf16 completions less than short ones."""
    n, ratio = m("04b_real_mismatch:real.trl_is.long_length"), m("04b_real_mismatch:real.trl_is.bf16_long_over_short")
    short = m("04b_real_mismatch:real.trl_is.short_length")
    if not m("04b_real_mismatch:real.trl_is.bf16_long_downweighted"):
        return (f"trl's default correction gave {n}-token bf16 completions {ratio:.2f}× the weight of {short}-token ones, "
                "within two standard errors: no length penalty resolved here")
    return (f"trl's default correction (a mask on the whole sequence's ratio) gave {n}-token bf16 completions {ratio:.2f}× the "
            f"weight of {short}-token ones, a length penalty: `vllm_importance_sampling_mode=\"token_truncate\"` or "
            "fp16 engines avoid it")


def _headroom(m) -> str:
    """Chapter 8's fp16 headroom of the real model: how far its largest activation sits below fp16's maximum."""
    place = {"residual": "residual stream", "attention_scores": "attention scores",
             "mlp_hidden": "MLP hidden activation"}[m("08_sensitive_ops:real.tightest")]
    return (f"SmolLM2-135M's largest activation, in its {place}, sits only "
            f"{m('08_sensitive_ops:real.min_headroom'):.1f}× below fp16's largest value: measure a model's headroom "
            "before moving its engines to fp16")


def _bf16_ratio(m) -> tuple[float, float, float]:
    key = "04b_real_mismatch:real.ratio.bf16_over_fp16"
    return m(key), m(f"{key}_low"), m(f"{key}_high")


def _slope_said(m) -> str:
    """Chapter 4b's fitted drift of the bf16 sequence log-ratio beside the drift its token KL implies."""
    try:
        slope, se = m("04b_real_mismatch:real.slope_per_1k.bf16"), m("04b_real_mismatch:real.slope_stderr_per_1k.bf16")
        drift = m("04b_real_mismatch:real.seq_kl_1k.bf16")
    except KeyError:
        return "the fitted drift is not in this build"
    agrees = "agrees with" if abs(slope + drift) <= 3 * se else "differs from"
    from_zero = "is not" if abs(slope) < 3 * se else "is"
    return (f"the sequence log-ratio's fitted slope, {slope:+.2f} ± {se:.2f} nats per 1K tokens, {agrees} the "
            f"{-drift:+.2f} its token KL implies and {from_zero} 3 standard errors from zero")


def _bf16_do(c: Context) -> str:
    """The bf16 situation's advice: its size from chapter 4b's ratio, its growth with length from link 2."""
    try:
        ratio, low, high = _bf16_ratio(c.read)
        size = (f"Expect a training–inference mismatch {comparative(low, high, 'larger', 'smaller')} fp16's: on the real 135M model "
                f"its token KL was {_ci(ratio, low, high, 0)} fp16's.")
    except KeyError:
        size = "Expect a training–inference mismatch between the two engines; its size is not measured in this build."
    growth = {SHOWN_LINK: "It accumulates with the response's length: the log-ratio of a sequence drifts in "
                          "proportion to its length (link 2 of the chain below).",
              UNRESOLVED: "Whether it accumulates with the response's length is unresolved here: "
                          + _slope_said(c.read) + " (link 2 of the chain below).",
              AGAINST: "It did not accumulate with the response's length here (link 2 of the chain below).",
              }.get(c.links.get("drift"), "Its growth with the response's length is not measured in this build.")
    restores = c.links.get("restores", NOT_TESTED)
    return (f"{size} {growth} Two remedies are proposed by others: {PAPER_SHORT} run both engines in fp16, with "
            f"a dynamic loss scaler and fp32 master weights; {TIS} keeps bf16 and reweights each token by π/μ. "
            f"This book's own test of such a correction is *{restores}* (link 4 below). Log the mismatch "
            "either way ({ref}`what to watch in your logs <findings-logs>`).")


def _merge_ratio(m) -> tuple[float, float, float]:
    """Chapter 7's real model: an unmerged bf16 trainer's token KL over the matched engines', with its interval."""
    key = "07_lora:real.serving.ratio"
    return tuple(m(f"{key}.{k}") for k in ("bf16_unmerged_over_matched", "low", "high"))


def _lora_do(c: Context) -> str:
    """The LoRA situation's advice: merging's effect in words from the real model's ratio and its interval."""
    try:
        real, low, high = _merge_ratio(c.read)
        merged = (f"adapters merged into bf16 base weights made the sampler differ from an unmerged bf16 trainer "
                  f"{comparative(low, high)} matched engines do: {_ci(real, low, high)} their token KL on the "
                  "real 135M model")
        try:
            merged += f" (on the toy model {c.read.toy('07_lora:serving.ratio.bf16_unmerged_over_matched'):.0f}×, " \
                      "whose matched engines barely disagree)"
        except KeyError:
            pass
    except KeyError:
        merged = "what merging adapters into a bf16 sampler adds to the mismatch is not measured in this build"
    try:
        lost = (f"chapter 7's rounding rule, checked on its runs, predicts bf16 adapters lose "
                f"{c.read('07_lora:predicted_lost_at_1e_5.bfloat16'):.0%} of their Adam updates at lr 1e-5 (its own "
                f"runs, at a larger rate, lost {c.read('07_lora:lost_update_fraction.bf16'):.1%})")
    except KeyError:
        lost = "bf16 adapters lose small updates (chapter 7)"
    return ("Keep the adapters and Adam's state in fp32; compute in bf16 or fp16. At RL learning rates "
            f"{lost}. With a separate sampler, check what the weight sync "
            f"hands it: {merged}. Merging in fp32 before the cast does not help, because the cast rounds the "
            "merged weight.")


def _fp8_do(c: Context) -> str:
    """FP8: which format's error is lower for gradients, from chapter 9's table; the sampler's size in words."""
    m = c.read
    try:
        e4, e5 = m("09_fp8:qerr.gradients.e4m3fn.tensor"), m("09_fp8:qerr.gradients.e5m2.tensor")
        lower = "E4M3" if e4 < e5 else "E5M2"
        formats = (f"With a scale per tensor, {lower}'s error was the lower on the lab model's gradients too "
                   f"(relative error E4M3 {e4:.3f}, E5M2 {e5:.3f}), and {DEEPSEEK_V3} uses E4M3 for every "
                   "tensor with fine-grained scales; E5M2's range is the usual choice for gradients under "
                   "delayed scaling, which this book does not measure.")
    except KeyError:
        formats = f"{DEEPSEEK_V3} uses E4M3 for every tensor with fine-grained scales."
    try:
        key = "05b_sampler_precision:real.dial.ratio.fp8_over_bf16"
        ratio, low, high = m(f"{key}.value"), m(f"{key}.low"), m(f"{key}.high")
        sequences, length = dial_size(c)
        tokens = (f"{sequences} sequences × {length} tokens = {sequences * length} tokens" if sequences
                  else "a few short sequences")
        sampler = (f"An FP8 sampler added a mismatch {comparative(low, high, 'larger', 'smaller')} bf16's on the "
                   f"real model, {_ci(ratio, low, high, 0)}: an order of magnitude, from {tokens}, with a per-tensor "
                   "activation scale that also spans the prompts' left padding.")
    except KeyError:
        sampler = "The FP8 sampler's mismatch on the real model is not measured in this build."
    return (f"FP8 needs a scale per tensor, channel or block. {formats} {sampler} Log the token KL and ESS "
            "between sampler and trainer, and correct as for bf16.")


def dial_size(c: Context) -> tuple[int | None, int | None]:
    """Chapter 5b's real-model dial: sequences and tokens each, from its results or its glued values."""
    m = c.read
    if m.has("05b_sampler_precision:real.dial.sequences") and m.has("05b_sampler_precision:real.dial.length"):
        return int(m("05b_sampler_precision:real.dial.sequences")), int(m("05b_sampler_precision:real.dial.length"))
    executed = c.root / "_build" / "executed" / "05b_sampler_precision.ipynb"
    if executed.is_file():
        import nbformat

        from .solutions import glued

        values = glued(nbformat.read(executed, as_version=4))
        try:
            return int(float(values["real_dial_sequences"])), int(float(values["real_dial_length"]))
        except (KeyError, ValueError):
            pass
    return None, None


def _update_kind(m) -> str:
    """The update-direction badge, from chapter 5c's own verdict: a loss shown on an emulated sampler shows the
    mechanism, not bf16's effect."""
    return {"shown": MECHANISM, "contradicted": AGAINST_HERE}.get(
        m("05c_update_direction:direction.verdict.biased"), INCONCLUSIVE)


def _update_numbers(m) -> str:
    key = "05c_update_direction:direction.at_paper."
    return (f"at fixed weights on the real 135M model, a GRPO update on the {m(key + 'label')} sampler's completions "
            f"({m(key + 'dose'):.2g} nats per completion, the dose nearest above bf16's at 1K tokens in chapter 4b) "
            f"keeps "
            f"{m(key + 'rho'):.2f} ± {m(key + 'rho_se'):.2f} of the last two blocks' on-policy update "
            f"({m('05c_update_direction:direction.verdict.biased')}; power {m(key + 'power'):.0%} for a loss of "
            f"{m('05c_update_direction:direction.smallest_drop'):.2f})")


def _fix_kind(m) -> str:
    """The bf16-vs-fp32 sampler comparison's badge: inconclusive where its interval includes zero."""
    gap, noise = m("05b_sampler_precision:decisive.bf16_gap"), m("05b_sampler_precision:decisive.bf16_noise")
    return INCONCLUSIVE if abs(gap) <= noise or math.isnan(gap) else MECHANISM


def _fix_numbers(m) -> str:
    gap, noise = m("05b_sampler_precision:decisive.bf16_gap"), m("05b_sampler_precision:decisive.bf16_noise")
    reading = ("the interval includes zero: no effect either way is resolved" if abs(gap) <= noise else
               "worse with the bf16 sampler, beyond the interval" if gap < 0 else
               "better with the bf16 sampler, beyond the interval")
    return (f"whether a bf16 sampler harms RL, on the toy with an fp32 trainer: score (mean of the last three "
            f"π-evals) of the bf16 sampler's runs minus the fp32 sampler's {gap:+.3f} (95% interval "
            f"±{noise:.3f}); {reading}")


def _cpu_speed(m) -> str:
    bf16 = m("04b_real_mismatch:perf.real.forward_tokens_per_s.bf16")
    fp16 = m("04b_real_mismatch:perf.real.forward_tokens_per_s.fp16")
    ratio = bf16 / fp16
    return (f"a plain forward of the real model ran {ratio:.1f}× {'slower' if ratio > 1 else 'faster'} in fp16 "
            f"than in bf16 in this build ({fp16:.0f} against {bf16:.0f} tokens per second)")


CAST_TRAINABLES = """for p in trainer.model.parameters():
    if p.requires_grad:  # trl leaves a quantized model's adapters in bf16
        p.data = p.data.float()"""


def _deepspeed_fp16(c: Context) -> str:
    """The fp16 section of the book's DeepSpeed config, as committed."""
    path = c.root / "configs" / "deepspeed_zero2_fp16.json"
    try:
        section = {"fp16": json.loads(path.read_text())["fp16"]}
    except (OSError, KeyError, ValueError):
        section = {"fp16": {"enabled": True, "loss_scale": 0}}
    return json.dumps(section, indent=2)


DEEPSPEED_NOTE = ("the fp16 section of the book's `configs/deepspeed_zero2_fp16.json`; `\"loss_scale\": 0` asks "
                  "for a dynamic scale, starting at 2^`initial_scale_power`")


def _trl_fp16(c: Context) -> str:
    d = c.defaults
    return (f"""from trl import GRPOConfig

# both engines in fp16 (the paper's fix)
args = GRPOConfig(output_dir="out", fp16=True,
                  use_vllm=True, vllm_mode="server")
# the vLLM server in fp16 too: trl vllm-serve --model <id> --dtype float16
# (colocated vLLM takes the checkpoint's dtype)

# or keep bf16, with trl's importance-sampling correction
# (the defaults of trl {d['trl']})
args = GRPOConfig(
    output_dir="out", bf16=True, use_vllm=True,
    vllm_importance_sampling_correction={d['trl_is_on']},
    vllm_importance_sampling_mode="{d['trl_is_mode']}",
    vllm_importance_sampling_clip_max={d['trl_is_clip']},
)""")


FINDINGS = [
    Finding(
        "crash", "An fp16-only GPU (T4, V100), or QLoRA GRPO with `fp16=True` anywhere",
        "The `…unscale_cuda … 'BFloat16'` crash comes from `fp16=True`, not `bf16=True`: `fp16=True` builds a "
        "GradScaler, and trl has cast the 4-bit model's trainables to bf16, which the CUDA unscale kernel does not "
        "take. On an fp16-only GPU keep `fp16=True` and cast the trainables to fp32 after building the trainer; "
        "on Ampere or newer use `bf16=True`, and cast the trainables to fp32 there too: trl leaves them in bf16, "
        "where small updates are lost (card 4). Whether to move both engines to fp16 against the mismatch is a "
        "separate choice (card 2).",
        (Config("trl", lambda c: f"""from trl import GRPOConfig, GRPOTrainer

# fp16-only GPU (T4, V100); on Ampere or newer: bf16=True
# (trl {c.defaults['trl']}: bf16 is on unless fp16=True)
args = GRPOConfig(output_dir="out", fp16=True)
trainer = GRPOTrainer(model=model, args=args, reward_funcs=reward,
                      train_dataset=dataset)
{CAST_TRAINABLES}"""),
         Config("bitsandbytes", """import torch
from transformers import BitsAndBytesConfig

quantization = BitsAndBytesConfig(
    load_in_4bit=True,
    # T4, V100; torch.bfloat16 on Ampere or newer
    bnb_4bit_compute_dtype=torch.float16,
)""", note="the 4-bit base of a QLoRA model, from bitsandbytes through transformers")),
        (Evidence("02_qlora_crash", "Root cause, in the installed code", SHOWN,
                  lambda m: (f"the installed accelerate builds a GradScaler for `fp16=True` "
                             f"{'and' if m('02_qlora_crash:source.bf16_builds_scaler') else 'but not'} for "
                             f"`bf16=True`"
                             f"{'' if m('02_qlora_crash:source.fp16_builds_scaler') else ' (nor for fp16 here)'}; "
                             f"trl leaves the trainables in {m('02_qlora_crash:audit.trainable_dtypes')}")),
         Evidence("02_qlora_crash", "Reproduce", NOT_SHOWN,
                  lambda m: "the crash itself needs the CUDA unscale kernel: the CPU build shows its mechanism")),
    ),
    Finding(
        "bf16", "Full fine-tuning RL on Ampere or Hopper with bf16 in both engines",
        _bf16_do,
        (Config("trl", _trl_fp16),
         Config("verl", """# both engines in fp16 (verl >= 0.6.1; the actor builds its own GradScaler)
actor_rollout_ref.actor.fsdp_config.dtype=float16
actor_rollout_ref.ref.fsdp_config.dtype=float16
actor_rollout_ref.rollout.dtype=float16

# or keep bf16, with token-level truncated importance sampling
algorithm.rollout_correction.rollout_is=token
algorithm.rollout_correction.rollout_is_threshold=2.0
actor_rollout_ref.rollout.calculate_log_probs=True""", lang="text",
                note="Hydra overrides for `python3 -m verl.trainer.main_ppo`, one per argument"),
         Config("accelerate", """from accelerate import Accelerator

# a GradScaler is built only for fp16
accelerator = Accelerator(mixed_precision="fp16")
# or: accelerate launch --config_file configs/fsdp_fp16.yaml train.py""",
                note="accelerate builds no GradScaler on a CPU"),
         Config("DeepSpeed", _deepspeed_fp16, lang="json", note=DEEPSPEED_NOTE),
         Config("vLLM", """vllm serve <model> --dtype float16
# batch-invariant kernels (beta): the same numbers whatever the batch
VLLM_BATCH_INVARIANT=1 vllm serve <model> --dtype float16""", lang="bash")),
        (Evidence("04b_real_mismatch", "The offline measurement", SHOWN,
                  lambda m: (f"SmolLM2-135M, token KL bf16 {_sci(m('04b_real_mismatch:real.token_kl.bf16'))} "
                             f"against fp16 {_sci(m('04b_real_mismatch:real.token_kl.fp16'))}: "
                             f"{_ci(*_bf16_ratio(m), 0)}; "
                             f"{m('04b_real_mismatch:real.seq_kl_1k.bf16'):.2f} nats per 1K tokens in bf16")),
         Evidence("05_grpo_precision", "The committed long run", SHOWN, lambda m: _during_rl(m)),
         Evidence("05c_update_direction", "The committed run", _update_kind, _update_numbers),
         Evidence("08_sensitive_ops", "Where fp16 overflows", SHOWN, _headroom),
         Evidence("04b_real_mismatch", "What trl's default correction does to long completions", SHOWN,
                  _trl_length_penalty),
         Evidence("05b_sampler_precision", "The pre-registered fix comparison", _fix_kind, _fix_numbers),
         Evidence("05_grpo_precision", "The source's table, and this run", NOT_SHOWN,
                  lambda m: "fp16's speed on an A100 or H100 and the paper's reward curves need a GPU")),
    ),
    Finding(
        "fp16", "Training in fp16 (any framework)",
        "Use a dynamic loss scaler: without one, small gradients flush to zero. Clip the gradients after "
        "unscaling them. The scale settles where the model's largest gradient allows; no band of scales is "
        "right for every model.",
        (Config("PyTorch", """scaler = torch.amp.GradScaler()
with torch.autocast("cuda", dtype=torch.float16):
    loss = model(**batch).loss
scaler.scale(loss).backward()
scaler.unscale_(optimizer)  # before clipping: clip the true gradients
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
scaler.step(optimizer)
scaler.update()"""),
         Config("accelerate", """accelerator = Accelerator(mixed_precision="fp16")
accelerator.backward(loss)
accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscales first"""),
         Config("DeepSpeed", _deepspeed_fp16, lang="json", note=DEEPSPEED_NOTE),
         Config("verl", """# an fp16 actor builds ShardedGradScaler(growth_interval=400) itself
# (verl/workers/actor/dp_actor.py, from Precision-RL's fp16 patch)
actor_rollout_ref.actor.fsdp_config.dtype=float16""", lang="text")),
        (Evidence("03_loss_scaling", "Which gradients underflow", SHOWN,
                  lambda m: (f"{_pct(m('03_loss_scaling:underflow_fraction.unscaled'))} of the lab model's "
                             "activation gradients flush to zero in fp16 without a scale")),),
    ),
    Finding(
        "lora", "LoRA or QLoRA adapters, any hardware",
        _lora_do,
        (Config("peft", """from peft import LoraConfig, get_peft_model

# autocast_adapter_dtype=True, the default since peft 0.12: fp32 adapters
model = get_peft_model(
    model, LoraConfig(r=16), autocast_adapter_dtype=True
)"""),
         Config("trl", lambda c: f"""trainer = GRPOTrainer(model=model, args=args, reward_funcs=reward,
                      train_dataset=dataset)
# trl casts a 4-bit or 8-bit model's trainables to bf16, and under ZeRO-3
# the adapters stay in the model's dtype: cast them to fp32 once it is built
{CAST_TRAINABLES}"""),
         Config("vLLM", """from vllm import LLM

# serve the adapters unmerged, unless the trainer scores the same
# merged and rounded weights
llm = LLM(model=base_model, enable_lora=True)""",
                note="unmerged serving is not measured in this book")),
        (Evidence("07_lora", "Where the adapter dtype comes from", SHOWN,
                  lambda m: "peft upcasts adapters to fp32 by default; trl casts a quantized model's to bf16"),
         Evidence("07_lora", "The other mechanism: a merged bf16 sampler against an unmerged trainer", SHOWN,
                  lambda m: (f"an unmerged bf16 trainer against a bf16 sampler with the adapters merged: "
                             f"{_ci(*_merge_ratio(m))} the matched engines' token KL on the real 135M model; "
                             f"on the toy model {m.toy('07_lora:serving.ratio.bf16_unmerged_over_matched'):.0f}×, "
                             "whose matched engines barely disagree"))),
    ),
    Finding(
        "moe", "Mixture-of-experts models",
        "Top-k routing turns rounding into discrete expert swaps between the two engines. Prefer routing replay "
        "(the trainer reuses the sampler's experts) to an fp32 router, which cannot remove the flips whose router "
        "input already differs. `expert_choice_precision` is not a parameter of anything.",
        (Config("verl", """# routing replay (R3): the trainer reuses the experts the sampler chose
# (Megatron actor, verl 0.7)
actor_rollout_ref.actor.router_replay.mode=R3
actor_rollout_ref.rollout.enable_rollout_routing_replay=True""", lang="text"),
         Config("transformers", """model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
# MixtralModel has no LM head: load the ...ForCausalLM class""")),
        (Evidence("06_moe", "Routing flips between the two engines", SHOWN,
                  lambda m: (f"expert choices that differ between the engines: bf16 "
                             f"{_pct(m('06_moe:flip_rate.bf16'))}, fp16 {_pct(m('06_moe:flip_rate.fp16'))} of "
                             "token-layer routings (the lab's tiny MoE)")),
         Evidence("06_moe", "Routing replay", SHOWN,
                  lambda m: (f"with replay {_pct(m('06_moe:replay.bf16.flip_rate'))} of the bf16 routings differ, "
                             f"and {_pct(m('06_moe:replay.bf16.kl_kept'))} of the bf16 token KL is left"))),
    ),
    Finding(
        "logprobs", "Log-probabilities, softmax and optimizer state",
        "Return log-probabilities in fp32. The source's softmax upcast recipe changes nothing: PyTorch's softmax "
        "already accumulates in fp32. Adam's default eps, 1e-8, is zero in fp16: keep optimizer states in fp32.",
        (Config("PyTorch", """logprobs = logits.float().log_softmax(-1)
optimizer = torch.optim.AdamW(model.parameters())  # on fp32 parameters"""),
         Config("trl", lambda c: f"""# default {c.defaults['trl_head']} in trl {c.defaults['trl']}; untied embeddings only
args = GRPOConfig(output_dir="out", cast_lm_head_to_fp32=True)""")),
        (Evidence("08_sensitive_ops", "Where the log-probabilities sit", SHOWN,
                  lambda m: f"a bf16 log-softmax was off by up to {m('08_sensitive_ops:err.log_softmax.bf16'):.2f} nats"),
         Evidence("08_sensitive_ops", "Adam's eps", SHOWN,
                  lambda m: f"Adam's default eps rounded to fp16: {m('08_sensitive_ops:adam.eps_in_fp16'):g}")),
    ),
    Finding(
        "fp8", "FP8 rollouts or training",
        _fp8_do,
        (Config("PyTorch", """# one scale per output channel
w8 = (w / scale[:, None]).to(torch.float8_e4m3fn)
# torch._scaled_mm multiplies FP8 matrices with their scales on Hopper"""),
         Config("vLLM", """vllm serve <model> --quantization fp8  # FP8 weights and activations""", lang="bash")),
        (Evidence("09_fp8", "Quantization error of real tensors", SHOWN,
                  lambda m: (f"per-tensor scale, relative error of the lab model's activations: E4M3 "
                             f"{m('09_fp8:qerr.activations.e4m3fn.tensor'):.3f}, E5M2 "
                             f"{m('09_fp8:qerr.activations.e5m2.tensor'):.3f}; of its gradients: E4M3 "
                             f"{m('09_fp8:qerr.gradients.e4m3fn.tensor'):.3f}, E5M2 "
                             f"{m('09_fp8:qerr.gradients.e5m2.tensor'):.3f}")),
         Evidence("05b_sampler_precision", "The dial on a real model", SHOWN,
                  lambda m: (f"SmolLM2-135M, against an fp32 trainer: token KL of a real FP8 sampler "
                             f"{_sci(m('05b_sampler_precision:real.dial.fp8_e4m3.token_kl'))}, of a bf16 one "
                             f"{_sci(m('05b_sampler_precision:real.dial.bf16.token_kl'))}"))),
    ),
    Finding(
        "cpu", "Running the book, or an experiment, on a CPU",
        "bf16 results depend on the CPU's kernels: the same seed draws other numbers under another kernel set. "
        "Compare against standard errors, never against one machine's draw. A CPU without fp16 matrix "
        "instructions runs fp16 at a speed of its own: time both before choosing (evidence below).",
        (Config("oneDNN", """# another kernel set for the same run
ONEDNN_MAX_CPU_ISA=AVX512_CORE python train.py  # or AVX2""", lang="bash"),),
        (Evidence("04b_real_mismatch", "The kernels move μ and π too", SHOWN,
                  lambda m: (f"the trainer's oneDNN against ATen kernels, same weights: token KL "
                             f"{_sci(m('04b_real_mismatch:kernels.trainer_onednn_vs_aten_token_kl'))}, against the "
                             f"engines' {_sci(m('04b_real_mismatch:kernels.sampler_vs_trainer_token_kl'))}")),
         Evidence("04b_real_mismatch", "Speed: sampling against a plain forward", SHOWN, _cpu_speed)),
    ),
]
CARD = {f.key: i for i, f in enumerate(FINDINGS, 1)}  # each situation's card number


# --- the book's mismatch numbers beside the reader's stack ----------------------------------------------

@dataclass(frozen=True)
class Stack:
    setup: str
    real: str | None  # the real 135M model's token KL for it
    toy: str | None  # the toy model's, shown beside it as a mechanism
    note: str = ""


STACKS = (
    Stack("vLLM sampling in bf16, a trainer that casts the whole model to bf16 (DeepSpeed's bf16 mode)",
          "04b_real_mismatch:real.token_kl.bf16", "04_mismatch:grid.bf16_bf16.token_kl", "offline"),
    Stack("the same, both engines in fp16", "04b_real_mismatch:real.token_kl.fp16",
          "04_mismatch:grid.fp16_fp16.token_kl", "offline"),
    Stack("trl with vLLM: a bf16 sampler, a trainer under autocast with fp32 master weights",
          "05_grpo_precision:real.rl.long.bf16_bf16.probe_kl_start", "05_grpo_precision:combo.bf16_bf16.mean_kl",
          "during GRPO, at its start"),
    Stack("the same with fp16 in both engines", "05_grpo_precision:real.rl.long.fp16_fp16.probe_kl_start",
          "05_grpo_precision:combo.fp16_fp16.mean_kl", "during GRPO, at its start"),
    Stack("a serving engine (llama.cpp here, vLLM in practice) sampling in bf16, a trainer cast whole to bf16: "
          "two programs", "04c_two_programs:cross.llamacpp_bf16.torch_bf16.token_kl", None, "offline"),
    Stack("the same two programs, both in fp16", "04c_two_programs:cross.llamacpp_f16.torch_fp16.token_kl", None,
          "offline; llama.cpp's default flash attention computes attention in F16"),
    Stack("the same, both in fp16, llama.cpp's flash attention off",
          "04c_two_programs:cross.llamacpp_f16_fa_off.torch_fp16.token_kl", None, "offline"),
    Stack("an 8-bit rollout engine (llama.cpp Q8_0), an fp32 trainer",
          "04c_two_programs:cross.llamacpp_q8_0.torch_fp32.token_kl", None, "offline"),
    Stack("a 4-bit rollout engine (llama.cpp Q4_0), an fp32 trainer",
          "04c_two_programs:cross.llamacpp_q4_0.torch_fp32.token_kl", None, "offline"),
    Stack("vLLM-style top-p 0.9 sampling in bf16, a bf16 trainer scoring the full distribution",
          "04c_two_programs:atlas.top_p_0_9.token_kl", None, "the truncation alone is −log(kept mass) per token"),
    Stack("temperature 0.7, the sampler's raw log-probabilities taken as μ (vLLM V1's default `logprobs_mode`)",
          "04c_two_programs:atlas.temperature_0_7_logprobs_raw.token_kl", None),
    Stack("bf16 in both engines with the LM head in fp32 on both sides",
          "04c_two_programs:atlas.fp32_head_both.token_kl", None),
    Stack("a bf16 sampler, an fp32 trainer", "05b_sampler_precision:real.dial.bf16.token_kl",
          "05b_sampler_precision:dial.bf16.token_kl"),
    Stack("a trainer that rounds its weights to bf16, a sampler that keeps fp32 weights",
          "04b_real_mismatch:real.token_kl.bf16_train_fp32_infer", "04_mismatch:grid.bf16_fp32.token_kl"),
    Stack("FP8 rollouts (vLLM's `quantization=\"fp8\"`), an fp32 trainer",
          "05b_sampler_precision:real.dial.fp8_e4m3.token_kl", "05b_sampler_precision:dial.fp8_e4m3.token_kl",
          "FP8 E4M3 decoder Linear layers, the rest bf16"),
    Stack("LoRA: adapters merged into a bf16 sampler, the trainer scoring them unmerged in bf16",
          "07_lora:real.serving.token_kl.unmerged_bf16", "07_lora:serving.token_kl.bf16.unmerged_bf16"),
    Stack("LoRA: sampler and trainer scoring the same merged bf16 weights", "07_lora:real.serving.token_kl.merged",
          "07_lora:serving.token_kl.bf16.merged"),
)


def stacks_table(read: Reader) -> str:
    """Where a reader's own set-up sits among the book's mismatch numbers: the real model's, the toy's beside."""
    def value(ref, reader):
        try:
            return _sci(reader(ref)) if ref else "—"
        except KeyError:
            return MISSING
    rows = []
    for s in STACKS:
        chapter = (s.real or s.toy).split(":")[0]
        rows.append([f"{s.setup}; {s.note}" if s.note else s.setup, value(s.real, read), value(s.toy, read.toy),
                     f"[{chapter.split('_')[0]}](chapters/{chapter}.ipynb)"])
    return table(["your set-up", "real 135M model", "toy model, mechanism only", "chapter"], rows)


# --- what to watch in your logs -------------------------------------------------------------------------

TRL_METRICS = {
    "sampling/sampling_logp_difference/mean": "mean over completion tokens of |log π − log μ|, from the raw "
                                              "log-probabilities",
    "sampling/sampling_logp_difference/max": "the largest |log π − log μ| of a token in the batch",
    "sampling/importance_sampling_ratio/min": "smallest π/μ weight after trl's correction: 0 where it masked a "
                                              "sequence or token",
    "sampling/importance_sampling_ratio/mean": "mean weight after the correction (1 when the engines agree)",
    "sampling/importance_sampling_ratio/max": "largest weight after the correction (at most the clip)",
}
VERL_NAMES = {
    "rollout_corr/k3_kl": "k3 estimate of KL[μ‖π] over the sampled tokens: the book's k3",
    "rollout_corr/kl": "k1 estimate: the mean of log μ − log π",
    "rollout_corr/chi2_token": "E[ρ²] − 1 per token, ρ = π/μ: the weights' variance",
    "rollout_corr/chi2_seq": "the same for the product of a sequence's weights",
    "rollout_corr/rollout_is_eff_sample_size": "effective sample size of the truncated weights, as a share",
    "rollout_corr/rollout_is_ratio_fraction_high": "share of weights above the threshold",
}
NEMO_NAMES = {
    "train/token_mult_prob_error": "mean over tokens of exp(|log π − log μ|): 1 when the engines agree",
    "train/gen_kl_error": "KL[μ‖π] of the sampled tokens, with the estimator `reference_policy_kl_type` names",
}


def trl_logged(source: Path | None = None) -> tuple[list[str], str]:
    """The mismatch metrics the installed trl's GRPOTrainer logs, read from its source, and its version."""
    import importlib.util
    from importlib import metadata

    if source is None:
        spec = importlib.util.find_spec("trl")
        if spec is None:
            return [], "not installed"
        source = Path(spec.origin).parent / "trainer" / "grpo_trainer.py"
    version = metadata.version("trl") if importlib.util.find_spec("trl") else "not installed"
    try:
        text = source.read_text()
    except OSError:
        return [], version
    found = re.findall(r"""_metrics\[mode\]\[["']([^"']+)["']\]""", text)
    wanted = [name for name in dict.fromkeys(found)
              if "sampling_logp_difference" in name or "importance_sampling_ratio" in name]
    return wanted, version


def _real_ranges(m: Reader) -> list[list[str]]:
    """The token KL the book measured on the real model, per engine precision: its range over chapters."""
    sources = {
        "bf16": ["04b_real_mismatch:real.token_kl.bf16", "04b_real_mismatch:real.k3.bf16",
                 "05_grpo_precision:real.rl.long.bf16_bf16.probe_kl_start",
                 "05_grpo_precision:real.rl.long.bf16_bf16.probe_kl_end"],
        "fp16": ["04b_real_mismatch:real.token_kl.fp16", "04b_real_mismatch:real.k3.fp16",
                 "05_grpo_precision:real.rl.long.fp16_fp16.probe_kl_start",
                 "05_grpo_precision:real.rl.long.fp16_fp16.probe_kl_end"],
        "FP8 sampler, fp32 trainer": ["05b_sampler_precision:real.dial.fp8_e4m3.token_kl"],
    }
    where = {"bf16": "4b offline, 5 during GRPO", "fp16": "4b offline, 5 during GRPO", "FP8 sampler, fp32 trainer":
             "5b, from few tokens"}
    rows = []
    for name, refs in sources.items():
        values = [float(m(r)) for r in refs if m.has(r)]
        values = [v for v in values if v > 0 and not math.isnan(v)]
        if not values:
            rows.append([name, MISSING, "", where[name]])
            continue
        low, high = min(values), max(values)

        def span(a: str, b: str) -> str:
            return a if a == b else f"{a} – {b}"
        rows.append([name, span(_sci(low), _sci(high)),
                     span(f"{math.sqrt(2 * low):#.2g}", f"{math.sqrt(2 * high):#.2g}"), where[name]])
    return rows


def logs_section(c: Context) -> list[str]:
    """Each framework's metric names for the mismatch, what each measures, and the book's reference ranges."""
    names, version = trl_logged()
    trl_lines = [f"  * `{n}`: {TRL_METRICS.get(n, 'a mismatch statistic')}" for n in names]
    if not trl_lines:
        trl_lines = [f"  * trl {version} logs no sampling-mismatch metric in its GRPOTrainer"]
    tag = f"v{version}" if version[:1].isdigit() else "main"
    lines = [
        "## What to watch in your logs", "",
        "Each framework logs the gap between the sampler's log-probabilities (μ) and the trainer's (π) of the "
        "sampled tokens under its own names:", "",
        f"* **trl {version}**, read from the installed "
        f"[`trl/trainer/grpo_trainer.py`]({FRAMEWORKS['trl']}/blob/{tag}/trl/trainer/grpo_trainer.py) "
        "(only with `use_vllm=True` and `vllm_importance_sampling_correction=True`, logged after trl's "
        "correction: the ratio statistics are of the truncated or masked weights):", *trl_lines,
        f"* **verl**, [`{VERL_METRICS[1]}`]({VERL_METRICS[0]}) (with `algorithm.rollout_correction` set and "
        "`calculate_log_probs=True`):",
        *[f"  * `{n}`: {what}" for n, what in VERL_NAMES.items()],
        f"* **NeMo-RL**, [`{NEMO_METRICS[1]}`]({NEMO_METRICS[0]}):",
        *[f"  * `{n}`: {what}" for n, what in NEMO_NAMES.items()], "",
        "What the book measured on the real 135M model, as token KL[μ‖π] in nats per token (exact, or its k3 "
        "estimate, which verl's `rollout_corr/k3_kl` and NeMo-RL's `gen_kl_error` with k3 report). The mean "
        "absolute log-probability difference (trl's `sampling_logp_difference/mean`, or NeMo-RL's "
        "`token_mult_prob_error` − 1) is not measured here; for small differences it is at most about "
        "√(2·KL), the column derived from the measured one. Expect other sizes on other models and prompts: "
        "confident reasoning text disagrees less per token than this model's chat text.", "",
        "```{table}", ":class: findings-narrow", "",
        table(["both engines in", "token KL measured (nats)", "mean absolute Δ log p, derived", "chapters"],
              _real_ranges(c.read)), "```", ""]
    try:
        n = max(int(k.split(".")[2]) for k in c.read.runs["04b_real_mismatch"]["metrics"]
                if re.fullmatch(r"real\.prefix_sd\.\d+\.measured", k))
        sd = c.read(f"04b_real_mismatch:real.prefix_sd.{n}.measured")
        lines += [f"trl's default mode, `{c.defaults['trl_is_mode']}`, weighs each completion by the product "
                  f"of its tokens' ratios. On the real model in bf16 the log of that product spread by {sd:.2f} "
                  f"nats (one standard deviation over sequences) at {n} tokens; trl masks a sequence whose "
                  f"ratio passes `vllm_importance_sampling_clip_max`, {c.defaults['trl_is_clip']}, a log-ratio of "
                  f"{math.log(float(c.defaults['trl_is_clip'])):.2f} nats.", ""]
    except (KeyError, ValueError):
        pass
    return lines


# --- the installed defaults the page quotes -------------------------------------------------------------

def installed_defaults() -> dict[str, str]:
    """The defaults the page quotes, read from the installed trl's GRPOConfig source (not imported: cheap)."""
    import ast
    import importlib.util
    from importlib import metadata

    spec = importlib.util.find_spec("trl")
    found = {"trl": metadata.version("trl") if spec else "not installed"}
    fields = {}
    if spec:
        source = Path(spec.origin).parent / "trainer" / "grpo_config.py"
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value, ast.Call):
                for keyword in node.value.keywords:
                    if keyword.arg == "default":
                        fields[node.target.id] = ast.unparse(keyword.value).strip("'\"")
    for name, field_name in (("trl_is_on", "vllm_importance_sampling_correction"),
                             ("trl_is_mode", "vllm_importance_sampling_mode"),
                             ("trl_is_clip", "vllm_importance_sampling_clip_max"),
                             ("trl_head", "cast_lm_head_to_fp32")):
        found[name] = fields.get(field_name, "(not in this trl)")
    return found


# --- evidence lines -------------------------------------------------------------------------------------

def _said(evidence: Evidence, read) -> str:
    """The evidence's sentence with this build's numbers, or why there is none."""
    try:
        return evidence.numbers(read)
    except KeyError:  # a chapter or metric missing from this build
        return MISSING


def _kind(evidence: Evidence, read, gpu: dict) -> str:
    """The evidence's badge: a function of its numbers where it has one; a GPU-only piece counts as shown once a
    committed GPU run of its chapter exists."""
    kind = evidence.kind
    if callable(kind):
        try:
            kind = kind(read)
        except KeyError:
            kind = MECHANISM
    return SHOWN if kind == NOT_SHOWN and evidence.chapter in gpu else kind


def _evidence(evidence: Evidence, read, gpu: dict) -> str:
    """One piece of evidence: its kind as a badge (none where this build lacks its numbers), link and numbers."""
    said = _said(evidence, read)
    kind = _kind(evidence, read, gpu)
    badge = f"{{bdg-{BADGES[kind]}}}`{kind}`" if said != MISSING else "{bdg-light}`not in this build`"
    return f"{badge} {_link(evidence.chapter, evidence.section)}: {said}"


# --- the causal chain: each link's status from the chapters' own conclusions --------------------------

SHOWN_LINK, UNRESOLVED, NOT_TESTED, AGAINST = "shown", "unresolved", "not tested", "contradicted"


def _verdict(found: list[dict], says: str) -> str:
    """The ledger's verdict (its first word) on the claim whose text starts with `says` ('' if none)."""
    entry = next((e for e in found if e["claim"].says.startswith(says)), None)
    return entry["verdict"].split(" (")[0] if entry else ""


def _from_verdict(verdict: str) -> str:
    """A ledger verdict as a link's status: inconclusive is unresolved; no measurement, not tested."""
    return {ledger.CONFIRMED: SHOWN_LINK, ledger.CONTRADICTED: AGAINST, ledger.INCONCLUSIVE: UNRESOLVED}.get(
        verdict, NOT_TESTED)


LINK_KEYS = ("mismatch", "drift", "biased", "restores", "scale")
LINK_CLAIMS = (None, None, "The mechanism at the update", "Importance-sampling corrections restore the on-policy", None)


def chain(root: Path) -> list[tuple[str, str, str]]:
    """The central story's links as (link, status, where it is decided)."""
    real = load_all(root / "_build" / "results").get("04b_real_mismatch", {}).get("metrics", {})
    found = ledger.entries(root)
    keys = ("real.token_kl.bf16", "real.token_kl.fp16", "real.token_kl_stderr.bf16", "real.token_kl_stderr.fp16")
    if all(k in real for k in keys):
        b, f, b_se, f_se = (real[k] for k in keys)
        mismatch = SHOWN_LINK if b - f > 3 * math.hypot(b_se, f_se) else UNRESOLVED  # 3 SE: one-sided, beyond doubt
    else:
        mismatch = NOT_TESTED
    # E[Σ log π/μ] = −Σ KL: the log-ratio accumulates exactly when the per-position KL stays above zero
    accumulates = (SHOWN_LINK if real.get("real.accumulation.shown") else AGAINST if real.get("real.accumulation.contradicted")
                   else UNRESOLVED if "real.accumulation.shown" in real else NOT_TESTED)
    biased = _from_verdict(_verdict(found, "The mechanism at the update"))
    restores = _from_verdict(_verdict(found, "Importance-sampling corrections restore the on-policy"))
    gpu = NOT_TESTED if not (root / "results" / "gpu" / "05b_sampler_precision.json").is_file() else UNRESOLVED
    return [("bf16 rounding makes the sampler's μ differ from the trainer's π", mismatch, "04b_real_mismatch"),
            ("the mismatch accumulates along the sequence (the token KL stays above zero at every position)",
             accumulates, "04b_real_mismatch"),
            ("GRPO on mismatched samples computes a biased update (it loses the on-policy direction)", biased,
             "05c_update_direction"),
            ("an importance-sampling correction restores the update's direction", restores, "05c_update_direction"),
            ("the same at the paper's scale: billions of parameters, GPUs, thousands of steps", gpu, "05b_sampler_precision")]


def link_details(root: Path) -> dict[str, str]:
    """The ledger's reasons (its verdict's parenthesis: the power, the completions that would decide) for the links
    the update-direction chapter decides, by the link's status word."""
    found = ledger.entries(root)
    details = {}
    for says in ("The mechanism at the update", "Importance-sampling corrections restore the on-policy"):
        entry = next((e for e in found if e["claim"].says.startswith(says)), None)
        if entry and " (" in entry["verdict"]:
            details[says] = entry["verdict"].split(" (", 1)[1].rstrip(")")
    return details


COLOURS = {SHOWN_LINK: "#2e7d32", UNRESOLVED: "#ef6c00", NOT_TESTED: "#757575", AGAINST: "#c62828"}
CHAIN_NODES = ["bf16 in both engines", "μ ≠ π (token KL)", "log π/μ drifts with length", "the update loses direction",
               "a correction restores it", "at the paper's scale"]


def chain_figure(links: list[tuple[str, str, str]], target: Path) -> Path:
    """The chain top to bottom: a box per node, an arrow per link coloured and labelled by its status.
    Narrow and tall, so that at the page's width its text is as large as the page's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.patches import FancyBboxPatch

    rows = len(CHAIN_NODES)
    fig, ax = plt.subplots(figsize=(4.6, 0.74 * rows))
    ax.set(xlim=(0, 6.4), ylim=(-rows + 0.6, 0.4))
    ax.axis("off")
    for i, text in enumerate(CHAIN_NODES):
        ax.add_patch(FancyBboxPatch((0.2, -i - 0.24), 4.6, 0.48, boxstyle="round,pad=0.04",
                                    facecolor="#f5f5f5", edgecolor="#424242"))
        ax.text(2.5, -i, text, ha="center", va="center", fontsize=12)
    for i, (_, status, _) in enumerate(links):
        colour = COLOURS[status]
        ax.annotate("", xy=(2.5, -i - 0.72), xytext=(2.5, -i - 0.3),
                    arrowprops=dict(arrowstyle="-|>", color=colour, lw=2.5))
        ax.text(3.0, -i - 0.5, status, ha="left", va="center", fontsize=12, color=colour, weight="bold")
    fig.tight_layout(pad=0.2)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="svg")
    plt.close(fig)
    return target


# --- the decision figure: from the reader's stack to the situation cards --------------------------------

# (question, [(answer, action, card key or None)]): each question applies in turn, top to bottom
DECISIONS = (
    ("Does the GPU compute in bf16? (compute capability ≥ 8.0: A100, L4, H100)",
     [("no: T4, V100", "fp16 with a loss scaler; cast trainables to fp32", "crash"),
      ("yes", "bf16 or fp16 training; the engines' dtype below decides", None)]),
    ("Full fine-tuning, or LoRA / QLoRA?",
     [("LoRA / QLoRA", "adapters and Adam state in fp32; serve them unmerged", "lora")]),
    ("Dense model or mixture of experts?",
     [("MoE", "routing replay (R3), not an fp32 router", "moe")]),
    ("Sampler engine and its dtype?",
     [("vLLM / SGLang in bf16", "both engines fp16, or bf16 with an IS correction", "bf16"),
      ("FP8 weights or activations", "scales per channel or block; E4M3", "fp8"),
      ("fp16 in both engines", "dynamic loss scaler; clip after unscaling", "fp16")]),
    ("Every stack", [("always", "log the mismatch: what to watch in your logs", None)]),
)


def _wrap(text: str, width: int) -> list[str]:
    """Words into lines of at most `width` characters."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + [line] if line else lines


FONT = 14  # px in the figure's own units; its viewBox is about as wide as the page's column, so this is on-screen size


def decision_figure(target: Path) -> Path:
    """The decision flow as a hand-laid SVG: questions down the left, each answer's action and card on the right."""
    width, left, right, gap, line_h = 680, 10, 330, 16, FONT + 5
    parts, y = [], 10
    for qi, (question, answers) in enumerate(DECISIONS):
        q_lines = _wrap(question, 32)
        rows = []
        for answer, action, card in answers:
            rows.append((answer, card, _wrap(action, 38)))
        row_h = [(1 + len(lines)) * line_h + 12 for _, _, lines in rows]
        block_h = max(len(q_lines) * line_h + 16, sum(row_h) + gap * (len(rows) - 1))
        q_h = len(q_lines) * line_h + 16
        q_y = y + (block_h - q_h) / 2
        parts.append(f'<rect x="{left}" y="{q_y:.0f}" width="270" height="{q_h:.0f}" rx="8" fill="#e3f2fd" '
                     'stroke="#1565c0"/>')
        for li, text in enumerate(q_lines):
            parts.append(f'<text x="{left + 135}" y="{q_y + 8 + (li + 1) * line_h - 4:.0f}" text-anchor="middle" '
                         f'font-weight="bold">{escape(text)}</text>')
        ry = y
        for (answer, card, lines), h in zip(rows, row_h):
            parts.append(f'<path d="M{left + 270},{q_y + q_h / 2:.0f} C{right - 30},{q_y + q_h / 2:.0f} '
                         f'{right - 30},{ry + h / 2:.0f} {right},{ry + h / 2:.0f}" fill="none" stroke="#616161" '
                         'stroke-width="1.5" marker-end="url(#arrow)"/>')
            parts.append(f'<rect x="{right}" y="{ry:.0f}" width="{width - right - 10}" height="{h:.0f}" rx="8" '
                         'fill="#f1f8e9" stroke="#2e7d32"/>')
            parts.append(f'<text x="{right + 10}" y="{ry + line_h + 2:.0f}" font-style="italic" '
                         f'fill="#1b5e20">{escape(answer)}</text>')
            if card:
                parts.append(f'<text x="{width - 20}" y="{ry + line_h + 2:.0f}" text-anchor="end" '
                             f'font-weight="bold" fill="#1b5e20">card {CARD[card]}</text>')
            for li, text in enumerate(lines):
                parts.append(f'<text x="{right + 10}" y="{ry + (li + 2) * line_h + 2:.0f}">{escape(text)}</text>')
            ry += h + gap
        y += block_h
        if qi < len(DECISIONS) - 1:
            parts.append(f'<line x1="{left + 135}" y1="{q_y + q_h:.0f}" x2="{left + 135}" y2="{y + gap + 4:.0f}" '
                         'stroke="#1565c0" stroke-width="2" marker-end="url(#arrow)"/>')
        y += gap * 2
    height = y
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height:.0f}" width="{width}" '
           f'height="{height:.0f}" font-family="DejaVu Sans, Arial, sans-serif" font-size="{FONT}" fill="#212121">'
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#616161"/></marker></defs>'
           '<rect width="100%" height="100%" fill="#ffffff"/>' + "".join(parts) + "</svg>\n")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(svg)
    return target


# --- the RL comparisons with their intervals ------------------------------------------------------------

FOREST = (("bf16 sampler − fp32 sampler", "decisive.bf16_gap", "decisive.bf16_noise"),
          ("matched fp32 − uncorrected 2-bit sampler", "decisive.gap_matched", "decisive.noise_matched"),
          ("token TIS − uncorrected 2-bit sampler", "decisive.gap_fix", "decisive.noise_fix"),
          ("token TIS − matched fp32", "decisive.gap_fix_vs_matched", "decisive.noise_fix_vs_matched"))


def forest_rows(root: Path) -> list[tuple[str, float, float]]:
    """Chapter 5b's RL comparisons as (label, difference in score, 95% half-width)."""
    metrics = load_all(root / "_build" / "results").get("05b_sampler_precision", {}).get("metrics", {})
    return [(label, metrics[gap], metrics[noise]) for label, gap, noise in FOREST if gap in metrics and noise in metrics]


def forest_figure(rows: list[tuple[str, float, float]], target: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 1.0 + 0.6 * len(rows)))
    for y, (label, gap, noise) in enumerate(reversed(rows)):
        ax.errorbar(gap, y, xerr=noise, fmt="o", color="#1565c0", capsize=4)
    ax.axvline(0, color="#424242", lw=1)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in reversed(rows)], fontsize=11)
    ax.set_xlabel("difference in score, with its 95% interval", fontsize=11)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="svg", bbox_inches="tight")
    plt.close(fig)
    return target


def _scale(read) -> str:
    """The lab's RL scale as this build's results give it: the toy's parameters, the long run's steps and seeds."""
    try:
        return (f"a {read('00_lab:params.dense') / 1e6:.2f}M-parameter model for "
                f"{read('05b_sampler_precision:decisive.bf16_steps')} steps, "
                f"{read('05b_sampler_precision:decisive.seeds')} seeds per arm")
    except KeyError:
        return "the lab's toy model for a few hundred steps"


def _link(chapter: str, section: str) -> str:
    """The chapter's link, and the section that measured it by its heading."""
    return f"[{chapter.split('_')[0]}](chapters/{chapter}.ipynb), *{section}*"


# --- the page -------------------------------------------------------------------------------------------

def _code(config: Config, c: Context) -> str:
    return config.code(c) if callable(config.code) else config.code


def config_blocks(c: Context) -> dict[str, list[tuple[str, str]]]:
    """Every situation's config blocks as (tool, code), for the page and its line-width test."""
    return {f.key: [(cfg.tool, _code(cfg, c)) for cfg in f.configs] for f in FINDINGS}


def _card(finding: Finding, number: int, c: Context, gpu: dict) -> list[str]:
    """One situation: a heading (for the page's contents), then a full-width card with what to do, a tab per
    framework with its copy-paste block, and the evidence."""
    do = finding.do(c) if callable(finding.do) else finding.do
    lines = [f"(findings-{finding.key})=", f"### {number}. {finding.situation}", "",
             "::::::{card}", ":class-card: findings-card", "", do, "",
             ":::::{tab-set}", ":sync-group: framework", ""]
    for config in finding.configs:
        code = _code(config, c)
        fence = "```"
        lines += [f"::::{{tab-item}} {config.tool}", f":sync: {config.tool}", "",
                  f"{fence}{config.lang}", code, fence, ""]
        if config.note:
            lines += [f"{config.note[0].upper()}{config.note[1:]}.", ""]
        lines += ["::::", ""]
    lines += [":::::", "", "**Evidence in this build**", ""]
    lines += [f"* {_evidence(e, c.read, gpu)}" for e in finding.evidence]
    lines += ["", "::::::", ""]
    return lines


def checklist(c: Context) -> list[str]:
    """The five things to check or change, each with its exact setting and its card."""
    def card(key):
        return f"{{ref}}`card {CARD[key]} <findings-{key}>`"
    try:
        ratio, low, high = _bf16_ratio(c.read)
        fp16_gain = (f"On the real 135M model, bf16 engines disagreed {comparative(low, high)} fp16 engines: "
                     f"{ratio:.0f}× their token KL (95% interval {low:.0f}–{high:.0f}).")
    except KeyError:
        fp16_gain = ""
    try:
        headroom = (f"First measure the model's largest activations: the real 135M model's sit only "
                    f"{c.read('08_sensitive_ops:real.min_headroom'):.1f}× below fp16's largest value (chapter 8).")
    except KeyError:
        headroom = ""
    return [
        "## Check these five things", "",
        f"1. **Adapters in fp32.** trl casts a 4-bit model's LoRA trainables to bf16, where small updates are "
        f"lost: after `GRPOTrainer(...)`, cast every `p` with `p.requires_grad` to `p.data.float()` ({card('lora')}).",
        f"2. **fp16 only with a dynamic loss scaler.** `GRPOConfig(fp16=True)` builds one through accelerate; "
        f"DeepSpeed needs `\"fp16\": {{\"enabled\": true, \"loss_scale\": 0}}` ({card('fp16')}).",
        f"3. **One 16-bit format in sampler and trainer, fp16 where you can.** {fp16_gain} Both in fp16: "
        f"`GRPOConfig(fp16=True)` with `trl vllm-serve --dtype float16`, or in verl "
        f"`actor_rollout_ref.rollout.dtype=float16` and the actor's `fsdp_config.dtype=float16` ({card('bf16')}). "
        f"{headroom}",
        "4. **Log the mismatch.** trl `sampling/sampling_logp_difference/mean`, verl `rollout_corr/k3_kl`, "
        "NeMo-RL `train/token_mult_prob_error` ({ref}`what to watch <findings-logs>`).",
        f"5. **Log-probabilities in fp32.** `logits.float().log_softmax(-1)`; in trl "
        f"`GRPOConfig(cast_lm_head_to_fp32=True)` for untied embeddings ({card('logprobs')}).", ""]


def page(root: Path, site: Path) -> str:
    """The findings page as MyST Markdown; its figures are written under `site/findings/`."""
    runs, gpu = load_all(root / "_build" / "results"), load_all(root / "results" / "gpu")
    read = Reader(runs)
    links, details = chain(root), link_details(root)
    c = Context(read, dict(zip(LINK_KEYS, (status for _, status, _ in links))), installed_defaults(), root)
    chain_figure(links, site / FIGURES / "chain.svg")
    decision_figure(site / FIGURES / "decide.svg")
    frameworks = ", ".join(f"[{name}]({url})" for name, url in FRAMEWORKS.items())
    lines = [
        "# Findings and what to do", "",
        f"What this book found about numeric precision in RL fine-tuning, starting from {PAPER} and its code, "
        f"{PRECISION_RL}, and the settings that follow, for {frameworks}. Every number on this page is read from "
        "this build's results, on the real 135M-parameter model wherever a chapter measured one; each card "
        "says what kind of evidence it has: *shown here*, *mechanism only* (shown on the lab's toy model or a "
        "CPU, not at a GPU's scale), *inconclusive* (measured, within its noise) or *not shown (needs a GPU)*.", "",
        *checklist(c),
        "## From your stack to the action", "",
        "Answer each question in turn; each answer on the right names its card below.", "",
        f"```{{figure}} {FIGURES}/decide.svg", ":name: findings-decide", ":class: findings-wide", "",
        "From the GPU, the fine-tuning method, the model and the sampler to the settings.", "```", "",
        "## What to do, by situation", ""]
    for number, finding in enumerate(FINDINGS, 1):
        lines += _card(finding, number, c, gpu)
    lines += ["(findings-logs)=", *logs_section(c),
              "## Which of the book's mismatch numbers is your stack", "",
              "The chapters measure the token KL[μ‖π] between sampler and trainer, in nats per token, in several "
              "set-ups. Each is shown beside the real configuration it stands for: the real 135M model's number "
              "gives the size; the toy model's, beside it, only the mechanism.", "",
              "```{table}", ":class: findings-stacks", "", stacks_table(read), "```", "",
              "(findings-doctor)=", "## Measure your stack", "",
              "None of these rows is your stack. The mismatch doctor measures yours: one sampler against one "
              "trainer on your model, with errors over sequences, and the metric names trl, verl and NeMo-RL "
              "would log the same quantities under:", "",
              "```bash", "python -m labutils.doctor --model YOUR_MODEL --sampler torch:bf16 \\",
              "    --trainer torch:bf16 --trainer-mode pure --tokens 512 --sequences 8", "```", "",
              "`--model` takes a `save_pretrained` directory or a hub id; `--sampler llama.cpp:bf16` measures "
              "the book's real model in a second program (chapter 4c). A healthy report: a token KL near the "
              "fp16 rows above, a log-weight drift per 1K tokens close to −1,000 × that KL, an effective sample "
              "size near the number of sequences, and trl's default correction masking no completion. Each "
              "line of the report says where it sits against the row of this table that matches its set-up.", "",
              "## The central story, link by link", "",
              "The argument of Qi et al. (2025) is a chain: bf16 rounding makes the two engines disagree, the "
              "disagreement accumulates along a sequence, RL on those samples computes a biased update and so "
              "degrades the policy, and fp16 or an importance-sampling correction prevents it. Each link is marked "
              "by what the chapters decided in this build: *shown*, *contradicted*, *unresolved* (measured, within "
              "its noise, with the power the measurement had) or *not tested*.", "",
              f"```{{figure}} {FIGURES}/chain.svg", ":name: findings-chain", "",
              "The causal chain; each arrow's colour and label come from the chapter that decides it.", "```", "",
              "```{table}", ":class: findings-links", "",
              table(["link", "status", "decided in"],
                    [[text, f"*{status}*" + (f" ({details[says]})" if says in details else ""),
                      f"[{chapter.split('_')[0]}](chapters/{chapter}.ipynb)"]
                     for (text, status, chapter), says in zip(links, LINK_CLAIMS)]), "```", ""]
    forest = forest_rows(root)
    if forest:
        forest_figure(forest, site / FIGURES / "forest.svg")
        lines += [
            "## The RL comparisons, with their intervals", "",
            "Chapter 5b's pre-registered comparisons of the trained policy's own accuracy (π-eval), as differences "
            "with 95% intervals over paired seeds. An interval that crosses zero is no evidence either way unless "
            "it is narrow enough to see the smallest effect that matters: the chapter states that power.", "",
            f"```{{figure}} {FIGURES}/forest.svg", ":name: findings-forest", "",
            "Differences in score (the mean of the last three π-evals) between samplers, 95% intervals.", "```", ""]
    degrades = _verdict(ledger.entries(root), "BF16 RL training degrades") or NOT_TESTED
    lines += [
        "## What this book could not show, and why", "",
        f"* **The consequence at the paper's scale.** The lab's RL runs train {_scale(read)} on a CPU. There the "
        f"claim that a bf16 sampler degrades RL is *{degrades}* "
        "(the forest plot above), and chapter 5b turns a dial of emulated formats past bf16's mismatch to see "
        "the mechanism. Whether bf16 degrades billion-parameter RL, and by how much, needs GPU runs of "
        "thousands of steps.",
        "* **GPU speed and memory.** fp16 against bf16 throughput on an A100 or H100, and the crash itself, need "
        "CUDA; the claims ledger marks them *not measured here* until a GPU reference run is committed.",
        "* **Numbers from one machine.** bf16 results depend on the CPU's kernel set; the build checks its "
        "verdicts under a second kernel set, and every comparison is judged against its own standard error.", "",
        "The claims ledger ({doc}`appendix/claims_ledger`) checks the source articles' claims one by one.", ""]
    return "\n".join(lines)
