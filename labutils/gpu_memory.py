"""A chapter's GPU memory, computed from the sizes its profile gives it: checked before any work, so that a
card too small for a chapter is told which profile value to lower instead of running out of memory midway.

    gpu_memory.check("04_mismatch", P)   # on a GPU: refuses, or warns, before the chapter samples anything
"""
from __future__ import annotations

import dataclasses


L4_GIB, A100_GIB, T4_GIB = 22, 40, 14.6  # the cards readers rent: Colab's L4 and T4, a 40 GB A100 (usable GiB)
COLAB_FREE_HOST_GB = 12.7  # the host memory of Colab's free T4 runtime, as its resource panel shows it
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Shape:
    """What memory depends on in a causal LM: its widths, depth and vocabulary."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    experts: int = 0
    params: int = 0  # 0: counted from the widths

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def parameters(self) -> int:
        if self.params:
            return self.params
        mlp = 3 * self.hidden * self.intermediate * max(1, self.experts)
        attention = 2 * self.hidden ** 2 + 2 * self.hidden * self.kv_heads * self.head_dim
        return self.layers * (attention + mlp) + self.vocab * self.hidden

    @property
    def kv_slot(self) -> int:
        """Bytes one cached token takes in one layer and one row of the sampler's cache (K and V, fp32)."""
        return 2 * self.kv_heads * self.head_dim * 4


LAB_VOCAB = 32  # the lab's character vocabulary (18 symbols), rounded up
# SmolLM2-135M-Instruct as its config states it (labutils.pretrained loads it; 134.5M parameters, tied embeddings)
SMOLLM2 = Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152, params=134_515_008)
CHAT_PROMPT = 64  # tokens of a chat-template prompt, rounded up
TOY_PROMPT = 8  # the lab task's prompt width, rounded up


def lab_shape(size) -> Shape:
    return Shape(size.hidden_size, size.num_layers, size.num_heads, size.num_kv_heads, size.intermediate_size,
                 LAB_VOCAB, size.num_experts)


def kv_cache_peak(shape: Shape, lengths, prompt: int) -> int:
    """Peak bytes of the sampler's KV cache (labutils.decoding), replayed step by step: every layer's buffer
    holds the rows still generating at a capacity that starts at max(prompt, 64) slots and doubles when full;
    a resize holds one layer's old and new buffers at once, and so does dropping finished rows."""
    lengths = sorted(int(n) for n in lengths)
    rows, capacity, peak, gone = len(lengths), max(prompt, 64), 0, 0
    slot, layers = shape.kv_slot, shape.layers
    peak = layers * rows * capacity * slot
    for step in range(lengths[-1]):
        while gone < len(lengths) and lengths[gone] <= step + 1:  # rows whose last token was this step's
            gone += 1
        going = len(lengths) - gone
        if going == 0:
            break
        if going < rows:  # batch_select_indices: one layer's kept rows copied while all layers hold the old
            peak = max(peak, slot * capacity * (layers * rows + going))
            rows = going
        if prompt + step + 1 > capacity:  # _resized: one layer's grown buffer beside its old one
            grown = max(2 * capacity, prompt + step + 1, 64)
            peak = max(peak, slot * rows * (layers * grown + capacity))
            capacity = grown
        peak = max(peak, layers * rows * capacity * slot)
    return peak


def sampling_bytes(shape: Shape, lengths, prompt: int, dtype_bytes: int = 4, keep_vocab: int | None = None) -> int:
    """GPU bytes of one InferenceEngine.sample call: its weights in the engine dtype, the KV cache's peak, the
    full-vocabulary log-probability buffer (allocated up front for `keep_vocab` rows, all when None), the
    per-row outputs, and one step's fp32 logits (cast, EOS ban, log-softmax: four copies)."""
    lengths = list(lengths)
    rows, steps = len(lengths), max(lengths)
    kept = rows if keep_vocab is None else min(rows, keep_vocab)
    return (dtype_bytes * shape.parameters + kv_cache_peak(shape, lengths, prompt)
            + 4 * kept * steps * shape.vocab + 13 * rows * steps + 16 * rows * shape.vocab)


def attention_scores_bytes(shape: Shape, rows: int, width: int, score_bytes: int = 4) -> int:
    """PyTorch's math attention kernel: rows × heads × width² scores, live twice (the scores and their softmax)."""
    return 2 * rows * shape.heads * width ** 2 * score_bytes


def scoring_bytes(shape: Shape, rows: int, width: int, dtype_bytes: int = 4, math: bool = False) -> int:
    """GPU bytes of one TrainingEngine forward over `rows` × `width` tokens without gradients: weights, about
    eight hidden-sized activations per token, the logits in the engine dtype and in fp32 (twice), and with
    `math` the attention scores the math kernel materialises (where no fused kernel takes the dtype and GQA)."""
    tokens = rows * width
    return (dtype_bytes * shape.parameters + 8 * tokens * max(shape.hidden, shape.intermediate // 2) * dtype_bytes
            + tokens * shape.vocab * (dtype_bytes + 8)
            + (attention_scores_bytes(shape, rows, width) if math else 0))


def training_bytes(shape: Shape, tokens: int) -> int:
    """GPU bytes of a training step: weights, gradients and AdamW state in fp32 (16 bytes a parameter), the
    activations a backward keeps (34 bytes per token, hidden unit and layer in 16-bit, Korthikanti et al.
    2022, doubled for fp32) and fp32 logits three times (logits, log-softmax, its gradient)."""
    return (16 * shape.parameters + 68 * tokens * shape.hidden * shape.layers + 12 * tokens * shape.vocab)


def _uniform(count: int, low: int, high: int) -> list[int]:
    """`count` lengths spread evenly over [low, high], as the chapters' uniform draws are in expectation."""
    return [low + round(i * (high - low) / max(1, count - 1)) for i in range(count)]


HOST_BASE = 1.5 * GIB  # a kernel with torch, transformers and trl imported, the lab model on the CPU


def memory_estimate(profile, math_attention: bool = True) -> dict[str, dict[str, float]]:
    """Per chapter: its peak GPU memory and host memory in GiB, computed from the sizes it uses in `profile`
    (not measured), and the part of the GPU peak that is the math attention kernel's scores.

    With `math_attention`, fp32 scoring with grouped-query attention takes PyTorch's math kernel (no fused
    CUDA kernel took fp32 with GQA before pytorch#191085), as does any dtype on a GPU below compute
    capability 8.0. The real-model chapters are estimated for SmolLM2-135M-Instruct, which they measure
    where its wheel is installed (else they measure the lab model, which needs far less).
    """
    from . import task

    dense, moe = lab_shape(profile.dense), lab_shape(profile.moe)
    m, routing, R, real_rl = profile.mismatch, profile.routing, profile.real, profile.real_rl
    math = math_attention and dense.kv_heads < dense.heads

    def rl_tokens(plan):
        return plan.batch_size * (TOY_PROMPT + task.completion_length(plan.max_walk) + 1)

    def mismatch_chapter(shape, count, low, high):
        lengths = _uniform(count, low, high)
        width = TOY_PROMPT + high
        sample = sampling_bytes(shape, lengths, TOY_PROMPT)
        score = scoring_bytes(shape, min(m.micro_batch, count), width, math=math)
        scores = attention_scores_bytes(shape, min(m.micro_batch, count), width) if math else 0
        # host: the rollout's and the scorer's vocabulary log-probabilities of every sequence, per precision
        host = 2 * 4 * count * high * shape.vocab
        return max(sample, score), scores, host

    def real_mismatch():
        lengths = [R.length] * R.sample_batch
        sample = sampling_bytes(SMOLLM2, lengths, CHAT_PROMPT, 2, keep_vocab=R.exact_sequences)
        score = scoring_bytes(SMOLLM2, R.micro_batch, CHAT_PROMPT + R.length, 2)
        host = 4 * R.length * SMOLLM2.vocab * (2 * min(R.sample_batch, R.exact_sequences) + R.micro_batch)
        return max(sample, score), 0, host

    def real_dial():
        lengths = [R.dial_length] * R.dial_sequences
        sample = sampling_bytes(SMOLLM2, lengths, CHAT_PROMPT, 4) + 4 * SMOLLM2.parameters  # fp32 trainer beside
        score = scoring_bytes(SMOLLM2, min(16, R.dial_sequences), CHAT_PROMPT + R.dial_length, 4)
        host = 3 * 4 * R.dial_sequences * R.dial_length * SMOLLM2.vocab
        return max(sample, score), 0, host

    def real_merge():  # chapter 7: the merged copy samples, two trainers rescore (16 sequences a forward)
        count, length = R.probe_sequences, 2 * R.probe_length
        models_ = 3 * 4 * SMOLLM2.parameters  # the fp32 policy, its merged copy, a 16-bit engine
        sample = models_ + sampling_bytes(SMOLLM2, [length] * count, CHAT_PROMPT, 2)
        score = models_ + scoring_bytes(SMOLLM2, min(16, count), CHAT_PROMPT + length, 2)
        host = 4 * count * length * SMOLLM2.vocab * 3.5  # sample, scored vocab, logits, the previous rescore
        return max(sample, score), 0, host

    def real_training():  # chapter 5's real-model runs: SmolLM2 in fp32 with AdamW, the engines beside
        tokens = real_rl.prompts_per_step * real_rl.group * (CHAT_PROMPT + real_rl.max_new_tokens)
        return training_bytes(SMOLLM2, tokens) + 2 * 4 * SMOLLM2.parameters, 0, 2 * GIB

    def toy(gpu_bytes, host=0):
        return gpu_bytes, 0, host

    sampler = profile.sampler
    need = {
        "00_lab": toy(training_bytes(dense, profile.warmup.batch_size * (
            TOY_PROMPT + task.completion_length(profile.warmup.max_walk))) + training_bytes(moe, 0)),
        "01_number_formats": toy(0.05 * GIB),
        "02_qlora_crash": max(toy(training_bytes(dense, rl_tokens(profile.grpo))),
                              toy(training_bytes(SMOLLM2, R.fix_batch * (CHAT_PROMPT + R.fix_completion)))),
        "03_loss_scaling": toy(training_bytes(dense, rl_tokens(profile.grpo))),
        "04_mismatch": mismatch_chapter(dense, m.sequences, m.min_len, m.max_len),
        "04b_real_mismatch": real_mismatch(),
        "05_grpo_precision": max(toy(training_bytes(dense, rl_tokens(profile.rl))), real_training()),
        "05b_sampler_precision": max(toy(training_bytes(dense, rl_tokens(profile.sampler_rl))),
                                     toy(sampling_bytes(dense, [sampler.dial_length] * sampler.dial_sequences,
                                                        TOY_PROMPT)), real_dial()),
        # the real model on the CPU in every profile: five engines and the trainer, nothing on the GPU
        "05c_update_direction": toy(0, 6 * 4 * SMOLLM2.parameters),
        # llama.cpp and three torch engines on the CPU, and the committed run's tables
        "04c_two_programs": toy(0, 4 * 4 * SMOLLM2.parameters),
        "06_moe": max(toy(training_bytes(moe, rl_tokens(profile.rl))),
                      mismatch_chapter(moe, routing.sequences, m.min_len, routing.max_len)),
        "07_lora": max(toy(training_bytes(dense, rl_tokens(profile.grpo))), real_merge()),
        "08_sensitive_ops": toy(scoring_bytes(dense, 16, TOY_PROMPT + task.completion_length(profile.task.max_walk))),
        # the n x 2n and 2n x n operands in fp32, bf16 and FP8, and the outputs, n = 4096; the real model stays
        # on the CPU
        "09_fp8": toy(36 * 4096 ** 2, 4 * SMOLLM2.parameters),
        # one GRPO process, and two on the one GPU when only one is there
        "10_scaling_out": toy(2 * training_bytes(dense, rl_tokens(profile.rl)), HOST_BASE),
        "11_troubleshooting": toy(0.2 * GIB),
    }
    return {stem: {"gpu_gib": round(gpu / GIB, 2), "math_scores_gib": round(scores / GIB, 2),
                   "host_gib": round((HOST_BASE + host) / GIB, 1)} for stem, (gpu, scores, host) in need.items()}


# per chapter, the profile value that sets its largest GPU allocation: what a reader lowers where it does not fit
KNOBS = {"00_lab": ("warmup", "batch_size"), "02_qlora_crash": ("real", "fix_batch"),
         "03_loss_scaling": ("grpo", "batch_size"), "04_mismatch": ("mismatch", "sequences"),
         "04b_real_mismatch": ("real", "sample_batch"), "05_grpo_precision": ("real_rl", "prompts_per_step"),
         "05b_sampler_precision": ("real", "dial_sequences"), "06_moe": ("routing", "sequences"),
         "07_lora": ("real", "probe_sequences"), "08_sensitive_ops": ("task", "max_walk"),
         "10_scaling_out": ("rl", "batch_size")}


def host_available_bytes() -> int | None:
    """The host memory the kernel can still take (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as info:
            return next(int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def refuse_if_too_big(chapter: str, profile, free_bytes: int, host_available: int | None = None) -> str | None:
    """Before any work: raise MemoryError, in one sentence naming the profile value to lower, where the chapter's
    computed peak GPU memory (`memory_estimate`) exceeds what the GPU has free even if attention takes a fused
    kernel, or its host memory beyond a started kernel's exceeds what the machine has available; return a
    warning where it fits only if attention takes a fused kernel (else None). `check` counts as free what this
    process's caching allocator holds unused (a second "Run all" in the same kernel); `host_available` None
    skips the host check."""
    estimate = memory_estimate(profile, math_attention=False)[chapter]
    fused = estimate["gpu_gib"] * GIB
    math = memory_estimate(profile, math_attention=True)[chapter]["gpu_gib"] * GIB
    host = estimate["host_gib"] * GIB - HOST_BASE  # the kernel itself is already running

    def lower(part, field):
        if part is None:
            return "free the GPU of other processes"
        return (f"lower `{part}.{field}` (now {getattr(getattr(profile, part), field)}) in labutils/profiles.py's "
                f"`{profile.name}` profile")

    said = (f"{chapter} needs about {{:.1f}} GiB of GPU memory at the `{profile.name}` profile's sizes and the GPU "
            f"has {free_bytes / GIB:.1f} GiB free")
    if fused > free_bytes:
        from .profiles import FULL_SIZE_GPU_BYTES

        return_to = (f' (profile="auto" takes smaller sizes on a card below {FULL_SIZE_GPU_BYTES // GIB} GiB)'
                     if profile.name == "gpu" else "")
        raise MemoryError(said.format(fused / GIB) + f": {lower(*KNOBS.get(chapter, (None, None)))}"
                          f"{return_to}, or run it where more is free.")
    if host_available is not None and host > host_available:
        knob = lower(*KNOBS[chapter]) if chapter in KNOBS else "close other programs"
        raise MemoryError(f"{chapter} needs about {host / GIB:.1f} GiB of host memory beyond the kernel's at the "
                          f"`{profile.name}` profile's sizes and this machine has {host_available / GIB:.1f} GiB "
                          f"available: {knob}, or run it on a machine with more memory.")
    if math > free_bytes:  # the math kernel's scores grow with the micro-batch, not with the sequences
        return (said.format(math / GIB) + " if attention takes PyTorch's math kernel (a fused kernel needs "
                f"{fused / GIB:.1f}); if it runs out of memory, {lower('mismatch', 'micro_batch')}.")
    return None


def check(chapter: str, profile) -> None:
    """On a GPU, `refuse_if_too_big` before the chapter's first allocation and print its warning; elsewhere nothing."""
    if profile.device == "cuda":
        import torch

        free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        warning = refuse_if_too_big(chapter, profile, free, host_available_bytes())
        if warning:
            print(warning)
