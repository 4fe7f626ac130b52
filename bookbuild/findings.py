"""The findings page: what the book found and what to do, by situation, with each row's evidence.

Generated at build time from `_build/results/*.json`, like the claims ledger: each number is this
build's, and each row's kind of evidence is read from the results where it can change (a committed
GPU run turns "not shown" into "shown"). The causal chain figure marks each link from the ledger's
verdicts, and the forest plot draws chapter 5b's RL comparisons with their intervals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Callable

from labutils.results import load_all
from . import ledger
from .status import table

SHOWN, MECHANISM, NOT_SHOWN = "shown here", "mechanism only", "not shown (needs a GPU)"
BADGES = {SHOWN: "success", MECHANISM: "info", NOT_SHOWN: "secondary"}
FIGURES = "findings"  # the figures' folder beside the page
MISSING = "not measured in this build"


@dataclass(frozen=True)
class Evidence:
    chapter: str
    section: str  # the heading that measured it, as the reader sees it
    kind: str  # SHOWN, MECHANISM or NOT_SHOWN
    numbers: Callable[[Callable], str]  # metric reader -> a short sentence with this build's numbers


@dataclass(frozen=True)
class Finding:
    situation: str
    do: str
    flags: dict[str, str]  # tool -> its exact setting
    evidence: tuple[Evidence, ...] = field(default_factory=tuple)


def _metric(runs: dict):
    """A reader of `chapter:key` from this build's results (KeyError where the chapter or key is missing)."""
    def read(ref: str):
        chapter, key = ref.split(":")
        value = runs[chapter]["metrics"][key]
        return float(value) if value in ("nan", "inf", "-inf") else value
    return read


def _during_rl(m) -> str:
    """Chapter 5's committed real-model run: each 16-bit pair's probe mismatch at its start and end."""
    def pair(name):
        key = f"05_grpo_precision:real.rl.long.{name}"
        seeds = m(f"{key}.seeds")
        return (f"{m(f'{key}.probe_kl_start'):.2g} → {m(f'{key}.probe_kl_end'):.2g} nats per token "
                f"({m(f'{key}.verdict')}; {seeds} seed{'s' * (seeds > 1)})")
    return (f"SmolLM2-135M trained by trl GRPO on a CPU for {m('05_grpo_precision:real.rl.long.steps')} steps "
            f"(lr {m('05_grpo_precision:real.rl.long.lr'):g}): the mismatch on fixed prompts went bf16/bf16 "
            f"{pair('bf16_bf16')}, fp16/fp16 {pair('fp16_fp16')}, while held-out accuracy went "
            f"{m('05_grpo_precision:real.rl.long.fp32_fp32.eval_start'):.2f} → "
            f"{m('05_grpo_precision:real.rl.long.fp32_fp32.eval_end'):.2f} in the fp32 control")


def _pct(x) -> str:
    return f"{x:.1%}"


FINDINGS = [
    Finding(
        "QLoRA GRPO (4-bit base, LoRA) with trl on an fp16-only GPU (T4, V100), or with `fp16=True` anywhere",
        "The `…unscale_cuda … 'BFloat16'` crash comes from `fp16=True`, not `bf16=True`: `fp16=True` builds a "
        "GradScaler, and trl has cast the 4-bit model's trainables to bf16, which the CUDA unscale kernel does not "
        "take. On an fp16-only GPU keep `fp16=True` and cast the trainables to fp32 after building the trainer; "
        "on Ampere or newer use `bf16=True`, and cast the trainables to fp32 there too: trl leaves them in bf16, "
        "where small updates are lost (LoRA row below). Whether to move both engines to fp16 against the "
        "mismatch is a separate choice (next row).",
        {"trl": "fp16-only GPU: `GRPOConfig(fp16=True)`, then `for p in trainer.model.parameters(): "
                "p.data = p.data.float() if p.requires_grad else p.data`. Ampere+: `GRPOConfig(bf16=True)` "
                "(trl $trl: `bf16` is on unless `fp16=True`) and the same cast",
         "bitsandbytes": "`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float16)` (T4) "
                         "or `torch.bfloat16` (Ampere+)"},
        (Evidence("02_qlora_crash", "Root cause, in the installed code", SHOWN,
                  lambda m: (f"installed accelerate builds a scaler for `fp16=True`: "
                             f"{m('02_qlora_crash:source.fp16_builds_scaler')}, for `bf16=True`: "
                             f"{m('02_qlora_crash:source.bf16_builds_scaler')}; trl leaves the trainables in "
                             f"{m('02_qlora_crash:audit.trainable_dtypes')}")),
         Evidence("02_qlora_crash", "Reproduce", NOT_SHOWN,
                  lambda m: "the crash itself needs the CUDA unscale kernel: the CPU build shows its mechanism")),
    ),
    Finding(
        "Full fine-tuning RL on Ampere or Hopper with bf16 in both engines",
        "Expect a training–inference mismatch tens of times larger than fp16's, accumulating with the response's "
        "length. Either run both engines in fp16, with a dynamic loss scaler and fp32 master weights, or keep bf16 "
        "and correct with importance sampling; log the mismatch KL either way.",
        {"trl": "`GRPOConfig(fp16=True)` and the vLLM server in fp16 (`trl vllm-serve --dtype float16`; colocated "
                "vLLM takes the checkpoint's dtype). IS correction: `vllm_importance_sampling_correction` "
                "(default $trl_is_on in trl $trl, mode `$trl_is_mode`, `vllm_importance_sampling_clip_max` "
                "$trl_is_clip; only with `use_vllm=True`)",
         "verl": "≥ 0.6.1: `actor_rollout_ref.actor.fsdp_config.dtype=float16`, "
                 "`actor_rollout_ref.ref.fsdp_config.dtype=float16`, `actor_rollout_ref.rollout.dtype=float16` "
                 "(the actor then builds its own GradScaler). IS correction: "
                 "`algorithm.rollout_correction.rollout_is=token`, `rollout_is_threshold=2.0`, with "
                 "`actor_rollout_ref.rollout.calculate_log_probs=True`",
         "accelerate": "`mixed_precision=\"fp16\"`: a GradScaler is built only for fp16, and not on the CPU",
         "DeepSpeed": "`\"fp16\": {\"enabled\": true, \"loss_scale\": 0}` (0: dynamic, from "
                      "2^`initial_scale_power`), as in the book's `configs/deepspeed_zero2_fp16.json`",
         "vLLM": "`--dtype float16`; `VLLM_BATCH_INVARIANT=1` for batch-invariant kernels (beta)"},
        (Evidence("04b_real_mismatch", "The offline measurement", SHOWN,
                  lambda m: (f"SmolLM2-135M, token KL bf16 {m('04b_real_mismatch:real.token_kl.bf16'):.2g} against fp16 "
                             f"{m('04b_real_mismatch:real.token_kl.fp16'):.2g}: "
                             f"{m('04b_real_mismatch:real.ratio.bf16_over_fp16'):.0f}× "
                             f"(95% interval {m('04b_real_mismatch:real.ratio.bf16_over_fp16_low'):.0f}–"
                             f"{m('04b_real_mismatch:real.ratio.bf16_over_fp16_high'):.0f}×); "
                             f"{m('04b_real_mismatch:real.seq_kl_1k.bf16'):.2f} nats per 1K tokens in bf16")),
         Evidence("05_grpo_precision", "The committed long run", SHOWN, lambda m: _during_rl(m)),
         Evidence("05b_sampler_precision", "The pre-registered fix comparison", MECHANISM,
                  lambda m: (f"whether a bf16 sampler harms RL, on the toy with an fp32 trainer: score (mean of "
                             f"the last three π-evals) of the bf16 sampler's runs minus the fp32 sampler's "
                             f"{m('05b_sampler_precision:decisive.bf16_gap'):+.3f} "
                             f"(95% interval ±{m('05b_sampler_precision:decisive.bf16_noise'):.3f})")),
         Evidence("05_grpo_precision", "The source's table, and this run", NOT_SHOWN,
                  lambda m: "fp16's speed on an A100 or H100 and the paper's reward curves need a GPU")),
    ),
    Finding(
        "Training in fp16 (any framework)",
        "Use a dynamic loss scaler: without one, small gradients flush to zero. Clip the gradients after "
        "unscaling them. The scale settles where the model's largest gradient allows; no band of scales is "
        "right for every model.",
        {"PyTorch": "`torch.amp.GradScaler()`; `scaler.unscale_(optimizer)` before `clip_grad_norm_`",
         "accelerate": "`Accelerator(mixed_precision=\"fp16\")`; `accelerator.clip_grad_norm_` unscales first",
         "DeepSpeed": "`\"fp16\": {\"enabled\": true, \"loss_scale\": 0, \"initial_scale_power\": 16}`",
         "verl": "an fp16 actor builds `ShardedGradScaler(growth_interval=400)` itself "
                 "(`verl/workers/actor/dp_actor.py`, from Precision-RL's fp16 patch)"},
        (Evidence("03_loss_scaling", "Which gradients underflow", SHOWN,
                  lambda m: (f"{_pct(m('03_loss_scaling:underflow_fraction.unscaled'))} of the lab model's activation "
                             "gradients flush to zero in fp16 without a scale")),),
    ),
    Finding(
        "LoRA or QLoRA adapters, any hardware",
        "Keep the adapters and Adam's state in fp32; compute in bf16 or fp16. With a separate sampler, check what "
        "the weight sync hands it: adapters merged into bf16 base weights make the sampler differ from an "
        "unmerged trainer far more than the dtype alone, and merging in fp32 before the cast does not help, "
        "because the cast rounds the merged weight.",
        {"peft": "`get_peft_model(model, config, autocast_adapter_dtype=True)` (the default since peft 0.12: "
                 "fp32 adapters)",
         "trl": "a 4-bit or 8-bit model's trainables are cast to bf16, and under DeepSpeed ZeRO-3 the adapters "
                "stay in the model's dtype: cast them to fp32 after building the trainer",
         "vLLM": "merge the adapters into the sampler's weights only if the trainer scores the same merged, "
                 "rounded weights; otherwise serve them unmerged (`enable_lora=True`; not measured here)"},
        (Evidence("07_lora", "Where the adapter dtype comes from", SHOWN,
                  lambda m: "peft upcasts adapters to fp32 by default; trl casts a quantized model's to bf16"),
         Evidence("07_lora", "The other mechanism: a merged bf16 sampler against an unmerged trainer", SHOWN,
                  lambda m: (f"an unmerged bf16 trainer against a bf16 sampler with the adapters merged: "
                             f"{m('07_lora:serving.ratio.bf16_unmerged_over_matched'):.0f}× the matched engines' "
                             f"token KL on the toy, "
                             f"{m('07_lora:real.serving.ratio.bf16_unmerged_over_matched'):.2f}× on the real model, "
                             "whose matched bf16 engines already disagree far more"))),
    ),
    Finding(
        "Mixture-of-experts models",
        "Top-k routing turns rounding into discrete expert swaps between the two engines. Prefer routing replay "
        "(the trainer reuses the sampler's experts) to an fp32 router, which cannot remove the flips whose router "
        "input already differs. `expert_choice_precision` is not a parameter of anything.",
        {"verl": "`actor_rollout_ref.actor.router_replay.mode=R3` with "
                 "`actor_rollout_ref.rollout.enable_rollout_routing_replay=True` (Megatron actor, verl 0.7)",
         "transformers": "`AutoModelForCausalLM.from_pretrained(..., dtype=...)`; `MixtralModel` has no LM head"},
        (Evidence("06_moe", "Routing flips between the two engines", SHOWN,
                  lambda m: (f"expert choices that differ between the engines: bf16 {_pct(m('06_moe:flip_rate.bf16'))}, "
                             f"fp16 {_pct(m('06_moe:flip_rate.fp16'))} of token-layer routings")),
         Evidence("06_moe", "Routing replay", SHOWN,
                  lambda m: (f"replay removes every flip and leaves {m('06_moe:replay.bf16.kl_kept'):.0%} of the bf16 "
                             "token KL"))),
    ),
    Finding(
        "Log-probabilities, softmax and optimizer state",
        "Return log-probabilities in fp32. The source's softmax upcast recipe changes nothing: PyTorch's softmax "
        "already accumulates in fp32. Adam's default eps, 1e-8, is zero in fp16: keep optimizer states in fp32.",
        {"PyTorch": "`logits.float().log_softmax(-1)`; `torch.optim.AdamW` on fp32 parameters",
         "trl": "`GRPOConfig(cast_lm_head_to_fp32=True)` (default $trl_head; untied embeddings only)"},
        (Evidence("08_sensitive_ops", "Where the log-probabilities sit", SHOWN,
                  lambda m: f"a bf16 log-softmax was off by up to {m('08_sensitive_ops:err.log_softmax.bf16'):.2f} nats"),
         Evidence("08_sensitive_ops", "Adam's eps", SHOWN,
                  lambda m: f"Adam's default eps rounded to fp16: {m('08_sensitive_ops:adam.eps_in_fp16'):g}")),
    ),
    Finding(
        "FP8 rollouts or training",
        "FP8 needs a scale per tensor or per channel. E4M3's finer spacing suits the forward pass (weights and "
        "activations), E5M2's range the gradients. An FP8 sampler adds a mismatch far beyond bf16's: log the "
        "token KL and ESS between sampler and trainer, and correct it as for bf16.",
        {"PyTorch": "`torch.float8_e4m3fn` with a per-channel scale; `torch._scaled_mm` on Hopper",
         "vLLM": "`quantization=\"fp8\"` for FP8 weights and activations"},
        (Evidence("09_fp8", "Quantization error of real tensors", SHOWN,
                  lambda m: (f"per-tensor activation error: E4M3 {m('09_fp8:qerr.activations.e4m3fn.tensor'):.3f}, "
                             f"E5M2 {m('09_fp8:qerr.activations.e5m2.tensor'):.3f}")),
         Evidence("05b_sampler_precision", "The dial on a real model", SHOWN,
                  lambda m: (f"SmolLM2-135M, against an fp32 trainer: token KL of a real FP8 sampler "
                             f"{m('05b_sampler_precision:real.dial.fp8_e4m3.token_kl'):.2g}, of a bf16 one "
                             f"{m('05b_sampler_precision:real.dial.bf16.token_kl'):.2g}: "
                             f"{m('05b_sampler_precision:real.dial.ratio.fp8_over_bf16.value'):.0f}× (95% interval "
                             f"{m('05b_sampler_precision:real.dial.ratio.fp8_over_bf16.low'):.0f}–"
                             f"{m('05b_sampler_precision:real.dial.ratio.fp8_over_bf16.high'):.0f}×)"))),
    ),
    Finding(
        "Running the book, or an experiment, on a CPU",
        "bf16 results depend on the CPU's kernels: the same seed draws other numbers under another kernel set. "
        "Compare against standard errors, never against one machine's draw. Without fp16 matrix instructions, "
        "fp16 runs many times slower than bf16.",
        {"oneDNN": "`ONEDNN_MAX_CPU_ISA=AVX512_CORE` (or `AVX2`) to try another kernel set"},
        (Evidence("04b_real_mismatch", "The kernels move μ and π too", SHOWN,
                  lambda m: (f"the trainer's oneDNN against ATen kernels, same weights: token KL "
                             f"{m('04b_real_mismatch:kernels.trainer_onednn_vs_aten_token_kl'):.2g}, against the "
                             f"engines' {m('04b_real_mismatch:kernels.sampler_vs_trainer_token_kl'):.2g}")),),
    ),
]


# the book's mismatch numbers, each beside the real set-up it stands for: (set-up, how the book builds it, metric)
STACKS = (
    ("vLLM in bf16 sampling, a trainer that casts the whole model to bf16 (DeepSpeed's bf16 mode)",
     "both engines pure bf16 copies, the real 135M model, chapter 4b", "04b_real_mismatch:real.token_kl.bf16"),
    ("the same, both engines in fp16", "both engines pure fp16 copies, chapter 4b", "04b_real_mismatch:real.token_kl.fp16"),
    ("the same on a tiny model", "the lab's toy model, chapter 4", "04_mismatch:grid.bf16_bf16.token_kl"),
    ("a bf16 sampler, an fp32 trainer", "chapter 5b's dial on the real 135M model",
     "05b_sampler_precision:real.dial.bf16.token_kl"),
    ("FP8 rollouts (vLLM's `quantization=\"fp8\"`), an fp32 trainer",
     "FP8 E4M3 decoder Linear layers, the rest bf16, the real 135M model, chapter 5b",
     "05b_sampler_precision:real.dial.fp8_e4m3.token_kl"),
    ("a bf16 sampler, a trainer under autocast with fp32 master weights (accelerate's mixed precision)",
     "chapter 5's engines during GRPO, toy model", "05_grpo_precision:combo.bf16_bf16.mean_kl"),
    ("a trainer that rounds its weights to bf16, a sampler that keeps fp32 weights",
     "bf16 trainer against fp32 sampler, toy model, chapter 4", "04_mismatch:grid.bf16_fp32.token_kl"),
    ("LoRA: adapters merged into a bf16 sampler, the trainer scoring them unmerged in bf16",
     "chapter 7's serving comparison, toy model", "07_lora:serving.token_kl.bf16.unmerged_bf16"),
    ("LoRA: sampler and trainer scoring the same merged bf16 weights",
     "chapter 7's matched engines", "07_lora:serving.token_kl.bf16.merged"),
    ("LoRA: adapters merged into a bf16 sampler, the trainer scoring them unmerged in bf16",
     "chapter 7's serving comparison, real 135M model", "07_lora:real.serving.token_kl.unmerged_bf16"),
)


def stacks_table(read) -> str:
    """Where a reader's own set-up sits among the book's mismatch numbers."""
    rows = []
    for setup, built, ref in STACKS:
        try:
            value = f"{read(ref):.2g}"
        except KeyError:
            value = MISSING
        chapter = ref.split(":")[0]
        rows.append([setup, built, value, f"[{chapter.split('_')[0]}](chapters/{chapter}.ipynb)"])
    return table(["your set-up", "what the book measures for it", "token KL[μ‖π] (nats)", "chapter"], rows)


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
        found[name] = f"`{fields[field_name]}`" if field_name in fields else "(not in this trl)"
    return found


def _said(evidence: Evidence, read) -> str:
    """The evidence's sentence with this build's numbers, or why there is none."""
    try:
        return evidence.numbers(read)
    except KeyError:  # a chapter or metric missing from this build
        return MISSING


def _evidence(evidence: Evidence, read, gpu: dict) -> str:
    """One piece of evidence: its kind as a badge (none where this build lacks its numbers), link and numbers."""
    said = _said(evidence, read)
    kind = _kind(evidence, gpu)
    badge = f"{{bdg-{BADGES[kind]}}}`{kind}`" if said != MISSING else "{bdg-light}`not in this build`"
    return f"{badge} {_link(evidence.chapter, evidence.section)}: {said}"


def _kind(evidence: Evidence, gpu: dict) -> str:
    """A GPU-only piece of evidence counts as shown once a committed GPU run of its chapter exists."""
    return SHOWN if evidence.kind == NOT_SHOWN and evidence.chapter in gpu else evidence.kind


# --- the causal chain: each link's status from the chapters' own conclusions --------------------------

SHOWN_LINK, UNRESOLVED, NOT_TESTED, AGAINST = "shown", "unresolved", "not tested", "contradicted"


def _verdict(found: list[dict], says: str) -> str:
    """The ledger's verdict (its first word) on the claim whose text starts with `says`."""
    entry = next(e for e in found if e["claim"].says.startswith(says))
    return entry["verdict"].split(" (")[0]


def _from_verdict(verdict: str) -> str:
    """A ledger verdict as a link's status: inconclusive is unresolved; no measurement, not tested."""
    return {ledger.CONFIRMED: SHOWN_LINK, ledger.CONTRADICTED: AGAINST, ledger.INCONCLUSIVE: UNRESOLVED}.get(
        verdict, NOT_TESTED)


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
    settled = real.get("real.drift_settled")  # the chapter's own test: the slope powered, and within 3 SE of the drift
    drift = NOT_TESTED if settled is None else SHOWN_LINK if settled else UNRESOLVED
    degrades = _from_verdict(_verdict(found, "The mechanism: the larger"))
    restores = _from_verdict(_verdict(found, "Importance-sampling corrections"))
    gpu = NOT_TESTED if not (root / "results" / "gpu" / "05b_sampler_precision.json").is_file() else UNRESOLVED
    return [("bf16 rounding makes the sampler's μ differ from the trainer's π", mismatch, "04b_real_mismatch"),
            ("the mismatch accumulates along the sequence (log π/μ drifts with length)", drift, "04b_real_mismatch"),
            ("RL on mismatched samples degrades the policy", degrades, "05b_sampler_precision"),
            ("an importance-sampling correction restores training", restores, "05b_sampler_precision"),
            ("the same at the paper's scale: billions of parameters, GPUs, thousands of steps", gpu, "05b_sampler_precision")]


COLOURS = {SHOWN_LINK: "#2e7d32", UNRESOLVED: "#ef6c00", NOT_TESTED: "#757575", AGAINST: "#c62828"}


def chain_figure(links: list[tuple[str, str, str]], target: Path) -> Path:
    """The chain as boxes joined by arrows, each arrow coloured by its link's status."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.patches import FancyBboxPatch

    nodes = ["bf16 in both\nengines", "μ ≠ π\n(token KL)", "weights drift\nwith length",
             "policy degrades\nin RL", "a correction\nrestores it", "at the paper's\nscale"]
    step, width = 1.5, 1.0  # node spacing and box width, in data units
    fig, ax = plt.subplots(figsize=(11, 1.8))
    ax.set(xlim=(-0.6, step * (len(nodes) - 1) + 0.6), ylim=(-0.75, 0.45))
    ax.axis("off")
    for i, text in enumerate(nodes):
        ax.add_patch(FancyBboxPatch((step * i - width / 2, -0.25), width, 0.6, boxstyle="round,pad=0.02",
                                    facecolor="#f5f5f5", edgecolor="#424242"))
        ax.text(step * i, 0.05, text, ha="center", va="center", fontsize=9)
    for i, (_, status, _) in enumerate(links):
        ax.annotate("", xy=(step * i + width / 2 + 0.45, 0.05), xytext=(step * i + width / 2 + 0.05, 0.05),
                    arrowprops=dict(arrowstyle="-|>", color=COLOURS[status], lw=2.5))
        ax.text(step * i + step / 2, -0.55, status, ha="center", va="center", fontsize=9, color=COLOURS[status],
                weight="bold")
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="svg")
    plt.close(fig)
    return target


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

    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.55 * len(rows)))
    for y, (label, gap, noise) in enumerate(reversed(rows)):
        ax.errorbar(gap, y, xerr=noise, fmt="o", color="#1565c0", capsize=4)
    ax.axvline(0, color="#424242", lw=1)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in reversed(rows)])
    ax.set(xlabel="difference in score, the mean of the last three π-evals (95% interval)")
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="svg")
    plt.close(fig)
    return target


def _scale(read) -> str:
    """The lab's RL scale as this build's results give it: the toy's parameters, the long run's steps and seeds."""
    try:
        return (f"a {read('00_lab:params.dense') / 1e6:.1f}M-parameter model for "
                f"{read('05b_sampler_precision:decisive.bf16_steps')} steps, "
                f"{read('05b_sampler_precision:decisive.seeds')} seeds per arm")
    except KeyError:
        return "the lab's toy model for a few hundred steps"


def _link(chapter: str, section: str) -> str:
    """The chapter's link, and the section that measured it by its heading."""
    return f"[{chapter.split('_')[0]}](chapters/{chapter}.ipynb), *{section}*"


def page(root: Path, site: Path) -> str:
    """The findings page as MyST Markdown; its two figures are written under `site/findings/`."""
    runs, gpu = load_all(root / "_build" / "results"), load_all(root / "results" / "gpu")
    read, defaults = _metric(runs), installed_defaults()
    rows = []
    for finding in FINDINGS:
        flags = "<br>".join(f"**{tool}:** {Template(setting).safe_substitute(defaults)}"
                            for tool, setting in finding.flags.items())
        evidence = "<br>".join(_evidence(e, read, gpu) for e in finding.evidence)
        rows.append([finding.situation, finding.do, flags, evidence])
    links = chain(root)
    chain_figure(links, site / FIGURES / "chain.svg")
    forest = forest_rows(root)
    lines = [
        "# Findings and what to do", "",
        "What this book found, by the situation you are in, and the settings that follow. Every number on this "
        "page is read from this build's results; each row links to the section that measured it and says what "
        "kind of evidence it is: *shown here* (measured in this build), *mechanism only* (the mechanism shown, "
        "on the lab's toy model or on a CPU, not the effect at a GPU's scale), or *not shown (needs a GPU)*.", "",
        "```{table}", ":class: findings", "",
        table(["situation", "what to do", "settings", "evidence"], rows), "```", "",
        "## Which of the book's mismatch numbers is your stack", "",
        "The chapters measure the mismatch between sampler and trainer in several set-ups, and their token KLs "
        "differ by orders of magnitude. This table puts each beside the real configuration it stands for. "
        "The toy model's numbers show mechanisms; the real model's show sizes.", "",
        stacks_table(read), "",
        "## The central story, link by link", "",
        "The argument of the paper this book starts from is a chain: bf16 rounding makes the two engines "
        "disagree, the disagreement accumulates along a sequence, RL on those samples degrades the policy, and "
        "fp16 or an importance-sampling correction prevents it. Each link is marked by what the chapters "
        "decided in this build: *shown*, *unresolved* (measured, within its noise) or *not tested*.", "",
        f"```{{figure}} {FIGURES}/chain.svg", ":name: findings-chain", "",
        "The causal chain; each arrow's colour and label come from the chapter that decides it.", "```", "",
        table(["link", "status", "decided in"],
              [[text, f"**{status}**", f"[{chapter.split('_')[0]}](chapters/{chapter}.ipynb)"]
               for text, status, chapter in links]), "",
    ]
    if forest:
        forest_figure(forest, site / FIGURES / "forest.svg")
        lines += [
            "## The RL comparisons, with their intervals", "",
            "Chapter 5b's pre-registered comparisons of the trained policy's own accuracy (π-eval), as differences "
            "with 95% intervals over paired seeds. An interval that crosses zero is no evidence either way unless "
            "it is narrow enough to see the smallest effect that matters: the chapter states that power.", "",
            f"```{{figure}} {FIGURES}/forest.svg", ":name: findings-forest", "",
            "Differences in score (the mean of the last three π-evals) between samplers, 95% intervals.", "```", ""]
    lines += [
        "## What this book could not show, and why", "",
        f"* **The consequence at the paper's scale.** The lab's RL runs train {_scale(read)} on a CPU. There the "
        f"claim that a bf16 sampler degrades RL is *{_verdict(ledger.entries(root), 'BF16 RL training degrades')}* "
        "(the forest plot above), and chapter 5b turns a dial of emulated formats past bf16's mismatch to see "
        "the mechanism. Whether bf16 degrades billion-parameter RL, and by how much, needs GPU runs of "
        "thousands of steps.",
        "* **GPU speed and memory.** fp16 against bf16 throughput on an A100 or H100, and the crash itself, need "
        "CUDA; the claims ledger marks them *not measured here* until a GPU reference run is committed.",
        "* **Numbers from one machine.** bf16 results depend on the CPU's kernel set; the build checks its "
        "verdicts under a second kernel set, and every comparison is judged against its own standard error.", "",
        "The claims ledger ({doc}`appendix/claims_ledger`) checks the source articles' claims one by one.", ""]
    return "\n".join(lines)
