"""Every size and step count of every chapter, per profile, in one place."""
from __future__ import annotations

from dataclasses import dataclass, replace

VALID_PROFILES = ("auto", "cpu", "gpu")


@dataclass(frozen=True)
class ModelSize:
    """Shape of a tiny causal LM built from config."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int = 2048
    num_experts: int = 0  # 0 -> dense Qwen2; >0 -> Mixtral-style MoE
    experts_per_token: int = 2


@dataclass(frozen=True)
class WarmupPlan:
    """Supervised warm-up on the scratchpad task."""

    steps: int
    batch_size: int
    lr: float
    min_walk: int  # walks trained on; longer ones are left for RL to learn
    max_walk: int


@dataclass(frozen=True)
class TaskRange:
    """Walk lengths the book evaluates and runs RL on."""

    min_walk: int
    max_walk: int
    eval_problems: int
    length_problems: int = 32  # problems per walk length in accuracy-by-length curves


@dataclass(frozen=True)
class GrpoPlan:
    """A GRPO run: steps, batch and group sizes, the walks its prompts ask for."""

    steps: int
    batch_size: int  # completions per step
    num_generations: int  # completions per prompt (the group)
    lr: float
    lora_rank: int
    min_walk: int
    max_walk: int
    prompts: int


@dataclass(frozen=True)
class MismatchPlan:
    """The offline mismatch measurement: how many sequences, of which lengths."""

    sequences: int
    min_len: int  # completion lengths are drawn uniformly in [min_len, max_len]
    max_len: int
    micro_batch: int  # the training engine's own batch size


@dataclass(frozen=True)
class RoutingPlan:
    """The MoE chapter's routing measurement: sequences of lengths uniform in [mismatch.min_len, max_len]."""

    sequences: int
    max_len: int  # attention cost grows with length squared; routing decisions only linearly
    probe_sequences: int  # of them, those the RL runs' routing probe rescores after every step


@dataclass(frozen=True)
class LongPlan:
    """Chapter 5b's long run, every threshold stated before it runs (labutils.long_run)."""

    steps: int  # GRPO steps per run
    lrs: tuple[float, ...]  # the learning rates swept on the fp32 control
    sweep_seeds: int  # fp32 seeds per learning rate, and seeds per dial setting of the dose–response
    eval_problems: int  # held-out problems of every π-eval
    eval_every: int
    min_gain: float  # π-eval accuracy every control seed must gain (mean of its last three evaluations)
    smallest_effect: float  # the smallest difference in that score a reader should care about
    dose_decades: float  # the dose–response's smallest slope that matters: smallest_effect lost over this many decades of token KL
    max_fix_seeds: int  # a cap on the fix comparison's seeds, whatever the power asks for
    budget_minutes: float  # the whole run's budget on the machine that makes it


@dataclass(frozen=True)
class SamplerPlan:
    """The sampler-precision chapter: offline dial, gradient bias, and the RL runs' evaluation."""

    dial_sequences: int  # sequences per dial setting, each `dial_length` tokens long
    dial_length: int
    bias_prompts: int  # fixed prompts of the gradient-bias measurement
    bias_group: int  # completions per prompt
    bias_batches: int  # batches averaged per gradient
    bits: int  # the coarse dial point every fix is compared at
    seeds: int  # seeds of the decisive comparison in this profile's run
    eval_problems: int  # held-out problems of the π-eval
    eval_every: int  # steps between π-evals
    collapse_margin: float  # π-eval accuracy below a seed's own running maximum that counts as a collapse
    long: LongPlan  # the long run behind the verdict (make long), fixed before any of its runs


@dataclass(frozen=True)
class RealPlan:
    """The real pretrained model's offline mismatch: sequences per engine precision, all `length` tokens long."""

    sequences: tuple[tuple[str, int], ...]  # (precision, sequences): fp16 runs 20x slower than bf16 on a CPU
    length: int  # completion tokens per sequence, EOS banned
    short_length: int  # fp16's and the fp32 control's, where each token costs more than bf16's (cpu: 256)
    micro_batch: int  # the training engine's sequences per forward (its logits are 196 KB per token)
    sample_batch: int  # sequences sampled at once (sampling reads every weight per token, whatever the batch)
    exact_sequences: int  # of each precision's sequences, those whose full distributions give the exact KL
    probe_sequences: int  # sequences per setting of the interventions (depth, temperature)
    probe_length: int
    probe_layers: tuple[int, ...]  # decoder layers kept in the depth intervention
    speed_batch: int  # sampling against a plain forward: sequences, and tokens each
    speed_length: int
    fix_steps: int  # chapter 2's three QLoRA fixes on the real model: GRPO steps of fix_batch completions,
    fix_batch: int  # each at most fix_completion tokens
    fix_completion: int
    # chapter 5b's offline dial on the real model (sampler settings against the fp32 trainer); the reading
    # compares real FP8 with real bf16, and real bf16 with its 7-bit emulation, so those three come first
    dial: tuple[str, ...] = ("bf16", "m7", "fp8")
    dial_sequences: int = 4
    dial_length: int = 32


@dataclass(frozen=True)
class RealRlPlan:
    """RL on the real model (labutils.real_rl): one run per engine pair and seed."""

    steps: int
    prompts_per_step: int
    group: int  # completions per prompt
    lr: float
    max_new_tokens: int
    eval_problems: int  # held-out numbers, sampled at the RL temperature
    eval_every: int
    temperature: float = 1.0
    seeds: int = 1
    probe_sequences: int = 0  # fixed prompts whose mismatch and drift are measured exactly at each evaluation


@dataclass(frozen=True)
class Profile:
    """Everything a chapter may size by profile."""

    name: str
    device: str  # where the chapters compute: "cpu" or "cuda"
    dense: ModelSize
    moe: ModelSize
    warmup: WarmupPlan
    moe_warmup: WarmupPlan
    task: TaskRange
    grpo: GrpoPlan  # QLoRA runs (LoRA learning rate)
    mismatch: MismatchPlan
    routing: RoutingPlan
    rl: GrpoPlan  # full fine-tuning runs that compare engine precisions
    sampler: SamplerPlan
    sampler_rl: GrpoPlan  # full fine-tuning runs with the sampler on the precision dial
    scaler_steps: int  # chapter 3's loss-scaled fp16 runs on the lab's model, per scaler setting
    bf16_native: bool = True  # False on a CUDA GPU below compute capability 8.0: bf16 runs emulated there
    # the CPU build's real-model runs: chapter 4b's speed at 8 x 32 tokens (the serving-sized 32 x 512 is the
    # committed `make speed` run), chapter 2's three QLoRA fixes four GRPO steps each (speed timed after the
    # first) of answers up to 12 tokens, as in the real-model RL task they train on
    real: RealPlan = RealPlan(sequences=(("bf16", 8), ("fp16", 4), ("fp32", 2)), length=1024, short_length=256,
                              exact_sequences=4, micro_batch=2, sample_batch=8, probe_sequences=4, probe_length=64,
                              probe_layers=(30, 15, 8, 3), speed_batch=8, speed_length=32,
                              fix_steps=4, fix_batch=4, fix_completion=12)
    # chapter 5's real-model RL in this build: a smoke test (fp16 steps take a minute each on a CPU); the
    # question is answered by the committed long run (make long-real, labutils.real_rl.LONG)
    real_rl: RealRlPlan = RealRlPlan(steps=1, prompts_per_step=1, group=2, lr=1e-5, max_new_tokens=12,
                                     eval_problems=4, eval_every=1)


_WARMUP_CPU = WarmupPlan(steps=250, batch_size=32, lr=3e-3, min_walk=1, max_walk=12)

PROFILES = {
    "cpu": Profile(
        name="cpu",
        device="cpu",
        dense=ModelSize(hidden_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                        intermediate_size=256),
        moe=ModelSize(hidden_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                      intermediate_size=96, num_experts=8, experts_per_token=2),
        warmup=_WARMUP_CPU,
        moe_warmup=replace(_WARMUP_CPU, steps=300),
        task=TaskRange(min_walk=1, max_walk=20, eval_problems=256),
        grpo=GrpoPlan(steps=4, batch_size=8, num_generations=4, lr=2e-3, lora_rank=8,
                      min_walk=2, max_walk=8, prompts=256),
        mismatch=MismatchPlan(sequences=64, min_len=32, max_len=850, micro_batch=16),
        routing=RoutingPlan(sequences=56, max_len=262, probe_sequences=16),
        # 4 steps of walks 4-10 (completions of at most 83 tokens with EOS): chapter 5 runs nine of these, chapter 6 two
        rl=GrpoPlan(steps=4, batch_size=16, num_generations=4, lr=3e-5, lora_rank=0,
                    min_walk=4, max_walk=10, prompts=256),
        sampler=SamplerPlan(dial_sequences=4, dial_length=256, bias_prompts=8, bias_group=4, bias_batches=6,
                            bits=2, seeds=1, eval_problems=64, eval_every=2, collapse_margin=0.10,
                            long=LongPlan(steps=80, lrs=(2e-4, 1e-4, 5e-5, 2e-5), sweep_seeds=4, eval_problems=512,
                                          eval_every=20, min_gain=0.02, smallest_effect=0.05, dose_decades=3.0,
                                          max_fix_seeds=16, budget_minutes=55)),
        sampler_rl=GrpoPlan(steps=4, batch_size=16, num_generations=4, lr=3e-4, lora_rank=0,
                            min_walk=6, max_walk=14, prompts=256),
        scaler_steps=30,
    ),
    "gpu": Profile(
        name="gpu",
        device="cuda",
        dense=ModelSize(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4,
                        intermediate_size=704, max_positions=4096),
        moe=ModelSize(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4,
                      intermediate_size=256, max_positions=4096, num_experts=8,
                      experts_per_token=2),
        warmup=WarmupPlan(steps=1000, batch_size=64, lr=2e-3, min_walk=1, max_walk=16),
        moe_warmup=WarmupPlan(steps=1000, batch_size=64, lr=2e-3, min_walk=1, max_walk=16),
        task=TaskRange(min_walk=1, max_walk=28, eval_problems=1024),
        grpo=GrpoPlan(steps=200, batch_size=64, num_generations=8, lr=1e-3, lora_rank=16,
                      min_walk=8, max_walk=24, prompts=4096),
        mismatch=MismatchPlan(sequences=1024, min_len=64, max_len=4000, micro_batch=64),
        routing=RoutingPlan(sequences=512, max_len=2000, probe_sequences=24),
        rl=GrpoPlan(steps=300, batch_size=64, num_generations=8, lr=1e-5, lora_rank=0,
                    min_walk=8, max_walk=24, prompts=4096),
        sampler=SamplerPlan(dial_sequences=32, dial_length=1000, bias_prompts=32, bias_group=8, bias_batches=16,
                            bits=2, seeds=4, eval_problems=512, eval_every=20, collapse_margin=0.10,
                            long=LongPlan(steps=2000, lrs=(3e-4, 1e-4, 3e-5), sweep_seeds=4, eval_problems=1024,
                                          eval_every=100, min_gain=0.02, smallest_effect=0.05, dose_decades=3.0,
                                          max_fix_seeds=32, budget_minutes=600)),
        sampler_rl=GrpoPlan(steps=200, batch_size=64, num_generations=8, lr=3e-4, lora_rank=0,
                            min_walk=8, max_walk=24, prompts=4096),
        scaler_steps=400,
        real=RealPlan(sequences=(("bf16", 64), ("fp16", 64), ("fp32", 16)), length=2048, short_length=2048,
                      exact_sequences=16, micro_batch=8,
                      sample_batch=16, probe_sequences=32, probe_length=1024, probe_layers=(30, 15, 8, 3),
                      speed_batch=32, speed_length=512, fix_steps=20, fix_batch=16, fix_completion=128,
                      dial=("bf16", "m7", "fp8", "fp32", "fp16", "fp8_channel", "m10", "m5", "m3", "m2"),
                      dial_sequences=16, dial_length=1024),
        real_rl=RealRlPlan(steps=200, prompts_per_step=16, group=8, lr=1e-5, max_new_tokens=32, eval_problems=256,
                           eval_every=20, seeds=2, probe_sequences=64),
    ),
}


GPU_PATHS_ON_CPU = "LAB_GPU_PATHS_ON_CPU"  # test mode, set by tests/test_gpu_paths.py; no reader's profile


def gpu_paths_on_cpu(gpu: Profile) -> Profile:
    """The gpu profile's layer shapes, group sizes and ranks on the CPU, every step, count, length and the
    depth at a minimum.

    It executes the gpu profile's code paths (shapes, configs, API calls) where CI runs; its numbers
    mean nothing: the models are one layer deep and barely warmed up.
    """
    short = dict(steps=2, batch_size=2 * gpu.grpo.num_generations, prompts=64, min_walk=1, max_walk=3)
    return replace(
        gpu, device="cpu", dense=replace(gpu.dense, num_layers=1), moe=replace(gpu.moe, num_layers=1),
        warmup=replace(gpu.warmup, steps=2, batch_size=4, max_walk=4),
        moe_warmup=replace(gpu.moe_warmup, steps=2, batch_size=4, max_walk=4),
        task=replace(gpu.task, eval_problems=8, length_problems=2, max_walk=4),
        grpo=replace(gpu.grpo, **short),
        rl=replace(gpu.rl, **short),
        sampler_rl=replace(gpu.sampler_rl, **short),
        # long enough for the 12-step walks chapters 5b and 6 sample, enough sequences for chapter 4's length buckets
        mismatch=replace(gpu.mismatch, sequences=16, min_len=32, max_len=300),
        routing=replace(gpu.routing, sequences=32, max_len=150),
        sampler=replace(gpu.sampler, dial_sequences=2, dial_length=128, bias_prompts=2, bias_batches=3, seeds=2,
                        eval_problems=8, eval_every=1),
        scaler_steps=2,
        real=replace(gpu.real, sequences=(("bf16", 2), ("fp16", 2), ("fp32", 2)), length=24, short_length=24,
                     exact_sequences=2, micro_batch=2,
                     probe_sequences=2, probe_length=16, speed_batch=2, speed_length=8,
                     fix_steps=1, fix_batch=8, fix_completion=8, dial=gpu.real.dial[:3],
                     dial_sequences=2, dial_length=16),
        real_rl=replace(gpu.real_rl, steps=1, prompts_per_step=1, group=2, max_new_tokens=2, eval_problems=2,
                        eval_every=1, seeds=1, probe_sequences=2),
    )


GPU_TRIMMED = "LAB_GPU_TRIMMED"  # set by `make gpu-check`: the gpu profile, trimmed to fit a short GPU lease


def gpu_trimmed(gpu: Profile) -> Profile:
    """The gpu profile's models, groups and lengths with fewer steps, seeds and sequences (`make gpu-check`)."""
    return replace(
        gpu,
        warmup=replace(gpu.warmup, steps=300), moe_warmup=replace(gpu.moe_warmup, steps=300),
        task=replace(gpu.task, eval_problems=256),
        grpo=replace(gpu.grpo, steps=20), rl=replace(gpu.rl, steps=30), sampler_rl=replace(gpu.sampler_rl, steps=20),
        # fp32 rescoring with grouped-query attention and no mask takes PyTorch's math kernel on every GPU (no
        # fused kernel takes fp32 with GQA): 8 sequences of 4,000 tokens at a time fit a 40 GB card, 64 do not
        mismatch=replace(gpu.mismatch, sequences=256, micro_batch=8),
        routing=replace(gpu.routing, sequences=128),
        sampler=replace(gpu.sampler, dial_sequences=8, bias_batches=4, seeds=2, eval_problems=128, eval_every=10),
        # chapter 7's probe at 4 sequences: its vocabulary log-probabilities fit a free Colab VM's 12.7 GB
        real=replace(gpu.real, sequences=(("bf16", 16), ("fp16", 16), ("fp32", 4)), length=1024, short_length=1024,
                     probe_sequences=4),
        # 4 prompts of 8 completions a step: chapter 5's real-model training fits a 15 GB card
        real_rl=replace(gpu.real_rl, steps=50, prompts_per_step=4, seeds=1),
    )


FULL_SIZE_GPU_BYTES = 70 * 2**30  # below it "auto" takes the trimmed gpu sizes (an 80 GB card shows about 79 GiB)
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 arithmetic, which the chapters compare


def resolve(profile: str) -> Profile:
    """Turn a chapter's `profile` parameter into a Profile.

    "auto" is "gpu" on any CUDA GPU, else "cpu". The gpu profile's sizes were set for an 80-141 GB card;
    on a smaller one (Colab's T4 and L4, a 40 GB A100) "auto" takes the trimmed sizes (`gpu_trimmed`,
    which every chapter's computed peak fits on a 15 GB T4) and sets GPU_TRIMMED, so that the processes a
    chapter starts take them too; "gpu" alone keeps the full sizes. A GPU below compute capability 8.0
    (a T4, a V100) has no bf16 arithmetic: its gpu profile has `bf16_native=False`, fp16 and fp32 run
    natively, and bf16 runs without bf16 tensor cores, slower; chapters say which of their parts that touches
    (`check_parameters(..., bf16_parts=...)`).
    """
    if profile not in VALID_PROFILES:
        raise ValueError(
            f"profile={profile!r} is not a profile; choose one of {', '.join(map(repr, VALID_PROFILES))}."
        )
    import os

    import torch

    if profile == "gpu" and os.environ.get(GPU_PATHS_ON_CPU) == "1":
        return gpu_paths_on_cpu(PROFILES["gpu"])
    if profile == "gpu" and not torch.cuda.is_available():
        raise ValueError("profile='gpu' needs a CUDA GPU and this machine has none; "
                         "use profile='cpu' (or 'auto', which picks it here).")
    small_card = False
    if profile == "auto":
        profile = "gpu" if torch.cuda.is_available() else "cpu"
        small_card = profile == "gpu" and torch.cuda.get_device_properties(0).total_memory < FULL_SIZE_GPU_BYTES
    chosen = PROFILES[profile]
    if small_card:  # the processes a chapter starts resolve "gpu": they must take the same sizes
        os.environ[GPU_TRIMMED] = "1"
    if profile == "gpu" and os.environ.get(GPU_TRIMMED) == "1":
        chosen = gpu_trimmed(chosen)
    if profile == "gpu" and torch.cuda.get_device_capability() < BF16_MIN_CAPABILITY:
        # bf16 attention with a mask takes PyTorch's math kernel there, whose scores grow with length²:
        # rescore 4 sequences of up to 4,000 tokens at a time, not 64
        chosen = replace(chosen, bf16_native=False, mismatch=replace(chosen.mismatch, micro_batch=4))
    return chosen


def bf16_note(profile: Profile, parts: str) -> str | None:
    """One sentence on what a GPU without bf16 arithmetic does with a chapter's bf16 `parts` (None elsewhere)."""
    if profile.bf16_native or profile.device != "cuda":
        return None
    import torch

    major, minor = torch.cuda.get_device_capability()
    return (f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no bf16 arithmetic: "
            f"{parts} run on it without bf16 tensor cores (values stored and rounded in bf16, matmuls accumulated "
            "in fp32, attention with a mask through PyTorch's math kernel), so their timings are not an Ampere "
            "GPU's and their attention rounding may differ from one; fp16 and fp32 run natively.")


def check_parameters(profile: str, seed: int, **optional) -> Profile:
    """Validate a chapter's parameters cell and resolve its profile; one clear sentence on a bad value.

    `optional` may carry `model_id` (None, a local directory or a hub id), `steps` (None -> the
    profile's, else a positive int), `bf16_parts` (what of the chapter runs in bf16, for the
    sentence a GPU without bf16 arithmetic gets).
    """
    chosen = resolve(profile)
    note = bf16_note(chosen, optional.get("bf16_parts") or "its bf16 parts")
    if note:
        print(note)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} is not a seed; pass a non-negative integer such as 0.")
    model_id = optional.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
        raise ValueError(f"model_id={model_id!r} is not a model; pass None (the lab's model), "
                         "a save_pretrained directory or a hub id.")
    steps = optional.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps={steps!r} is not a step count; pass None (the profile's) or a positive integer.")
    return chosen
