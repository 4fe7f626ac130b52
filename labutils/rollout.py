"""Two engines from the same weights: one samples (μ), one rescores what was sampled (π).

The inference engine works like a serving stack: its own copy of the weights in P_inf, a KV
cache, one new token per forward, and the sampled token's log-probability recorded in that
same forward. The training engine works like a trainer: the weights in P_train, one
teacher-forced forward over whole sequences, in micro-batches of its own size and order.
Same weights, same maths; only the order and the precision of the arithmetic differ.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import decoding, moe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def engine_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """The torch dtype for `name` ("fp32", "bf16", "fp16"), checked to run on `device`."""
    if name not in DTYPES:
        raise ValueError(f"precision {name!r} is not an engine precision; choose one of {', '.join(DTYPES)}.")
    dtype = DTYPES[name]
    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} was asked for but CUDA is not available; use device='cpu'.")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=True):
            raise RuntimeError(f"{torch.cuda.get_device_name(torch.device(device))} cannot hold bf16 tensors; "
                               "use fp16 or fp32 on this GPU.")
    try:  # the one operation every engine needs: a matmul in this dtype on this device
        probe = torch.ones(2, 2, dtype=dtype, device=device)
        (probe @ probe).sum().item()
    except RuntimeError as err:
        raise RuntimeError(f"{name} matrix multiplication does not run on {device!r} ({err}); "
                           "choose another precision for this device.") from None
    return dtype


def special_ids(config) -> tuple[int, int]:
    """(pad id, EOS id) of a model config: EOS pads where the checkpoint names no pad token."""
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, (list, tuple)) else config.eos_token_id
    if eos is None:
        raise ValueError(f"{config.name_or_path or config.model_type!r} has no eos_token_id in its config; "
                         "completions end at EOS here: load it with labutils.models.load, or set config.eos_token_id.")
    return (eos if config.pad_token_id is None else config.pad_token_id), eos


def cache_keyword(model) -> str:
    """The name a model's forward takes its KV cache by: `cache` in newer transformers, `past_key_values`
    before. A wrong name vanishes into **kwargs and every step decodes without context, raising nothing."""
    import inspect

    forward = inspect.signature(model.forward).parameters
    return "cache" if "cache" in forward else "past_key_values"


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token (padding on either side)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class Rollout:
    """Sampled completions with the inference engine's log-probabilities of them.

    `completion_ids` is right-padded with the pad id; `mask` marks real tokens (EOS included);
    `logprobs` is log μ of each sampled token; `vocab_logprobs` (when kept) is log μ of every
    vocabulary entry at each position, float32. Where a row banned EOS (`min_new_tokens`, like a
    serving stack's `min_tokens`), the ban is part of the policy and the training engine applies it too.
    """

    prompt_ids: list[list[int]]
    completion_ids: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    vocab_logprobs: torch.Tensor | None = None
    experts: torch.Tensor | None = None  # [B, T, layers, k] experts chosen for the input predicting each token
    prompt_experts: torch.Tensor | None = None  # [B, prompt width, layers, k] prefill routing, left-padded (-1: pad)
    min_new_tokens: torch.Tensor | None = None  # per row: EOS was banned before this many tokens
    seconds: float = 0.0

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)

    def first(self, n: int) -> "Rollout":
        """The first `n` rows, with everything recorded about them."""
        return self.rows(0, n)

    def rows(self, start: int, stop: int) -> "Rollout":
        """Rows `start` to `stop` (exclusive), with everything recorded about them."""
        cut = (lambda t: None if t is None else t[start:stop])
        return Rollout(self.prompt_ids[start:stop], self.completion_ids[start:stop], self.mask[start:stop],
                       self.logprobs[start:stop], cut(self.vocab_logprobs), cut(self.experts), cut(self.prompt_experts),
                       cut(self.min_new_tokens), self.seconds)

    def completions(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.completion_ids, self.lengths)]

    def token_logprobs(self) -> list[list[float]]:
        return [row[:n].tolist() for row, n in zip(self.logprobs, self.lengths)]


class InferenceEngine:
    """A private copy of the policy in `dtype` that samples with a KV cache.

    `dial` (a `sampler_precision.Dial`: fp8, fp8_channel, m2 … m10) makes the copy compute like an FP8
    serving engine or an emulated low-precision one; `sampler_precision.engine(name)` builds one.
    """

    def __init__(self, model, dtype: torch.dtype, device: str = "cpu", dial=None):
        self.dial = dial
        if self.dial is not None and DTYPES[self.dial.engine_dtype] != dtype:
            raise ValueError(f"sampler precision {self.dial.name!r} runs on {self.dial.engine_dtype} weights, "
                             f"not {dtype}; build the engine with sampler_precision.engine().")
        self.model = _fresh_copy(model, dtype, device)
        self.model.set_attn_implementation(decoding.ATTENTION)  # one-query attention as serving kernels run it
        self.dtype, self.device = dtype, device
        if self.dial is not None:
            self.dial.install(self.model)
            self.sync(model)  # the quantized layers start from the trainer's weights, not from a rounded copy
        self.pad_id, self.eos_id = special_ids(self.model.config)
        self._cache_kw = cache_keyword(self.model)

    @torch.no_grad()
    def sync(self, model) -> None:
        """Load the trainer's current weights, cast to this engine's dtype (a weight sync)."""
        own = self.model.state_dict()  # an FP8 engine holds its quantized layers in fp32, the rest in its dtype
        state = {k: v.detach().to(own[k].dtype) for k, v in _plain_state(model).items()}
        self.model.load_state_dict(state, strict=True)
        if self.dial is not None:
            self.dial.quantize_weights(self.model)

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], max_new_tokens, min_new_tokens=0,
               temperature: float = 1.0, generator: torch.Generator | None = None,
               keep_vocab: bool | int = False, keep_experts: bool = False) -> Rollout:
        """Sample one completion per prompt, recording log μ of each token in the sampling forward.

        `keep_vocab` keeps log μ of the whole vocabulary for every row (True) or for the first n rows (an int:
        a 49K vocabulary is 196 KB per token). `max_new_tokens` and `min_new_tokens` are an int or one int per prompt; EOS cannot be
        sampled before a row's minimum, and a row stops at its maximum. `keep_experts` (MoE
        models) records the experts each layer chose for the input that predicted each token.
        """
        from time import perf_counter

        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be positive; sampling needs a distribution.")
        start = perf_counter()
        batch, width = len(prompt_ids), max(len(p) for p in prompt_ids)
        budget = _per_row(max_new_tokens, batch, "max_new_tokens").to(self.device)
        floor = _per_row(min_new_tokens, batch, "min_new_tokens").to(self.device)
        if bool((floor > budget).any()) or int(budget.min()) < 1:
            raise ValueError("every row needs 1 <= min_new_tokens <= max_new_tokens.")
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompt_ids):  # left padding: every row's next token is at the end
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = _positions(mask)
        steps = int(budget.max())
        completion = torch.full((batch, steps), self.pad_id, dtype=torch.long, device=self.device)
        alive = torch.zeros((batch, steps), dtype=torch.bool, device=self.device)  # not `!= pad`: pad can be sampled
        logps = torch.zeros((batch, steps), device=self.device)
        kept = batch if keep_vocab is True else min(batch, int(keep_vocab))
        vocab = torch.zeros((kept, steps, self.model.config.vocab_size), device=self.device) if kept else None
        rows = torch.arange(batch, device=self.device)  # original index of each row still generating
        cache = decoding.cache()
        recorder = moe.RouterRecorder(self.model) if keep_experts else contextlib.nullcontext()
        with recorder:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1)
            experts = prompt_experts = None
            if keep_experts:  # routing of the last prompt token, which predicts completion token 0
                experts = torch.full((batch, steps, len(recorder.latest), recorder.modules[0].top_k), -1,
                                     dtype=torch.long, device=self.device)
                prompt_experts = torch.stack([c.view(batch, width, -1) for c in recorder.latest], dim=2)
                prompt_experts = prompt_experts.masked_fill(~mask.bool()[..., None, None], -1)
                for layer, chosen in enumerate(recorder.latest):
                    experts[:, 0, layer] = chosen.view(batch, width, -1)[:, -1]
            self._decode(out, steps, budget, floor, rows, mask, positions, cache, temperature, generator,
                         completion, alive, logps, vocab, experts, recorder)
        used = int(alive.any(0).sum())
        return Rollout(prompt_ids=[list(p) for p in prompt_ids], completion_ids=completion[:, :used].cpu(),
                       mask=alive[:, :used].cpu(), logprobs=logps[:, :used].cpu(),
                       vocab_logprobs=vocab[:, :used].cpu() if kept else None,
                       experts=experts[:, :used].cpu() if keep_experts else None,
                       prompt_experts=prompt_experts.cpu() if keep_experts else None,
                       min_new_tokens=floor.cpu(), seconds=perf_counter() - start)

    def _decode(self, out, steps, budget, floor, rows, mask, positions, cache, temperature, generator,
                completion, alive, logps, vocab, experts, recorder):
        """The token-by-token loop; writes into the preallocated output tensors."""
        for step in range(steps):
            token, going = sample_step(out.logits[:, -1].float(), step, rows, floor, budget, temperature, generator,
                                       self.eos_id, completion, alive, logps, vocab)
            if not bool(going.any()):
                break
            if not bool(going.all()):  # finished rows leave the batch, as in continuous batching
                keep = going.nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, token, mask, positions = rows[keep], token[keep], mask[keep], positions[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                             **{self._cache_kw: cache}, use_cache=True)
            if experts is not None:  # the routing of token `step`, which predicts token `step + 1`
                for layer, chosen in enumerate(recorder.latest):
                    experts[rows, step + 1, layer] = chosen


def sample_step(logits, step: int, rows, floor, budget, temperature: float, generator, eos_id: int,
                completion, alive, logps, vocab) -> tuple[torch.Tensor, torch.Tensor]:
    """The serving stack's sampler at one step, the same for every engine: fp32 logits of the rows still
    generating, EOS banned below each row's floor, tempered, one token drawn per row (`_draw`); the token,
    its log μ and (where kept) the vocabulary's log μ are written into the outputs. Returns the tokens and
    which of `rows` go on."""
    logits = _ban_eos(logits, eos_id, step < floor[rows])
    step_logp = torch.log_softmax(logits / temperature, dim=-1)
    token = _draw(step_logp, rows, len(completion), generator)
    completion[rows, step], alive[rows, step] = token, True
    logps[rows, step] = step_logp.gather(-1, token[:, None]).squeeze(-1)
    if vocab is not None:
        stored = rows < vocab.shape[0]
        vocab[rows[stored], step] = step_logp[stored]
    return token, (token != eos_id) & (step + 1 < budget[rows])


def _draw(logp: torch.Tensor, rows: torch.Tensor, batch: int, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row still generating (`rows`, of `batch`) by the Gumbel-max trick: argmax of log p plus
    a Gumbel draw for every vocabulary entry.

    Each step draws for the whole batch, so a row's draws depend on the seed, its index and the step only,
    never on which other rows have ended; and two engines whose distributions differ slightly pick the same
    token unless the perturbation moves the argmax, so samplers seeded alike stay coupled until a row's first
    differing token (inverse-CDF sampling splits as soon as any cumulative sum moves past the uniform). The
    uniforms are float64, so that the Gumbel's tail is not cut where a float32 uniform would end (at 2^-24).
    """
    uniform = torch.rand((batch, logp.shape[-1]), dtype=torch.float64, device=logp.device, generator=generator)
    scores = logp - torch.log(-torch.log(uniform[rows]))  # a uniform of 0 gives -inf: never chosen
    best = scores.max(-1)
    if not bool(torch.isfinite(best.values).all()):
        raise RuntimeError("the sampler's probabilities are not finite: the policy's weights or logits hold inf "
                           "or NaN (chapter 11, row 7); find the first non-finite weight, not a sampler fix.")
    return best.indices


def _per_row(value, batch: int, name: str) -> torch.Tensor:
    values = torch.as_tensor(value, dtype=torch.long)
    if values.ndim == 0:
        return values.repeat(batch)
    if values.shape != (batch,):
        raise ValueError(f"{name} must be an int or one int per prompt ({batch}), got shape {tuple(values.shape)}.")
    return values


def _ban_eos(logits: torch.Tensor, eos_id: int, banned: torch.Tensor) -> torch.Tensor:
    """Logits with EOS at -inf where `banned` (broadcast over the leading dimensions)."""
    if not bool(banned.any()):
        return logits
    eos = torch.zeros_like(logits, dtype=torch.bool)
    eos[..., eos_id] = True
    return logits.masked_fill(eos & banned[..., None], float("-inf"))


def _fresh_copy(model, dtype: torch.dtype, device: str):
    """The same weights in a new model object: no hooks, wrappers or trainer state come along."""
    inner = getattr(model, "module", model)
    clone = type(inner)(copy.deepcopy(inner.config))  # its own config: an engine may set its attention
    clone.load_state_dict(_plain_state(inner))
    # the rotary frequencies stay fp32, as serving and training stacks compute them (only cos and sin are cast):
    # a bf16 inv_freq would add a phase error that grows with position, in no real engine
    frequencies = {name: buffer.detach().clone() for name, buffer in clone.named_buffers() if name.endswith("inv_freq")}
    clone = clone.to(device=device, dtype=dtype)
    for name, buffer in frequencies.items():
        path, _, leaf = name.rpartition(".")
        clone.get_submodule(path)._buffers[leaf] = buffer.to(device)
    return clone.eval()


def _plain_state(model) -> dict:
    """A model's weights with the names of the bare transformers model (peft and DDP wrappers removed)."""
    inner = getattr(model, "module", model)
    if hasattr(inner, "merge_and_unload"):
        raise ValueError("sync() takes a plain transformers model; merge peft adapters first "
                         "(model.merge_and_unload()) or sync from the base model.")
    return inner.state_dict()


class TrainingEngine:
    """The policy in `dtype`, scoring whole sequences with one teacher-forced forward per micro-batch."""

    def __init__(self, model, dtype: torch.dtype, device: str = "cpu", micro_batch: int = 16):
        if micro_batch < 1:
            raise ValueError(f"micro_batch={micro_batch} must be a positive number of sequences.")
        self.model = _fresh_copy(model, dtype, device)
        self.dtype, self.device, self.micro_batch = dtype, device, micro_batch
        self.pad_id, self.eos_id = special_ids(self.model.config)

    @torch.no_grad()
    def score(self, rollout: Rollout, temperature: float = 1.0, keep_vocab: bool = False,
              order: torch.Tensor | None = None, keep_experts: bool = False, replay: bool = False) -> "Scored":
        """log π of every sampled token (and of the whole vocabulary when `keep_vocab`), float32.

        `order` permutes which sequences share a micro-batch, as a trainer's own batching would.
        `keep_experts` (MoE models) records each layer's experts for the input predicting each token.
        `replay` (MoE models) routes every token to the experts the sampler chose (routing replay);
        the rollout must have been sampled with `keep_experts=True`.
        """
        if replay and (rollout.experts is None or rollout.prompt_experts is None):
            raise ValueError("replay needs the sampler's routing: sample with keep_experts=True.")
        batch, steps = rollout.completion_ids.shape
        order = torch.arange(batch) if order is None else order
        logprobs = torch.zeros(batch, steps)
        vocab = experts = None
        recorder = moe.RouterRecorder(self.model) if keep_experts else contextlib.nullcontext()
        replayer = moe.RoutingReplay(self.model) if replay else contextlib.nullcontext()
        with replayer, recorder:  # replay first: the recorder then sees the experts actually used
            for start in range(0, batch, self.micro_batch):
                rows = order[start:start + self.micro_batch]
                ids, _, offsets = pack(rollout, rows, self.pad_id)
                if replay:
                    replayer.plan(_replayed_routing(rollout, rows, ids.shape[1], offsets))
                logits = self.model(**packed_inputs(ids, self.device)).logits.float().cpu()
                if keep_experts:
                    chosen = torch.stack([c.view(len(rows), ids.shape[1], -1) for c in recorder.latest], dim=2).cpu()
                    if experts is None:
                        experts = torch.full((batch, steps, *chosen.shape[2:]), -1, dtype=torch.long)
                for i, row in enumerate(rows.tolist()):  # the positions that predicted each completion token
                    where = slice(offsets[i] - 1, offsets[i] - 1 + steps)
                    span = logits[i, where]
                    if rollout.min_new_tokens is not None:
                        span = _ban_eos(span, self.eos_id, torch.arange(steps) < rollout.min_new_tokens[row])
                    span = torch.log_softmax(span / temperature, dim=-1)
                    logprobs[row] = span.gather(-1, rollout.completion_ids[row].clamp(min=0)[:, None]).squeeze(-1)
                    if keep_vocab:
                        if vocab is None:
                            vocab = torch.zeros(batch, steps, span.shape[-1])
                        vocab[row] = span
                    if keep_experts:
                        experts[row] = chosen[i, where]
        return Scored(logprobs * rollout.mask, vocab, experts)


def _replayed_routing(rollout: Rollout, rows: torch.Tensor, width: int, offsets: list[int]) -> list[torch.Tensor]:
    """Per layer, the sampler's experts at every position of a packed micro-batch ([rows·width, k]; -1: none)."""
    layers, k = rollout.experts.shape[2:]
    plan = torch.full((len(rows), width, layers, k), -1, dtype=torch.long)
    prompt_width = rollout.prompt_experts.shape[1]
    for i, row in enumerate(rows.tolist()):
        start = offsets[i]  # the prompt sits at [0, start) here and at the right end of the sampler's prefill
        plan[i, :start] = rollout.prompt_experts[row, prompt_width - start:]
        used = int(rollout.mask[row].sum())
        plan[i, start - 1:start - 1 + used] = rollout.experts[row, :used]
    return [plan[:, :, layer].reshape(-1, k) for layer in range(layers)]


class Scored(NamedTuple):
    """The training engine's view of a rollout: log π per sampled token, per vocabulary entry, experts."""

    logprobs: torch.Tensor
    vocab: torch.Tensor | None = None
    experts: torch.Tensor | None = None


def pack(rollout: Rollout, rows: torch.Tensor, pad_id: int):
    """Right-padded prompt+completion for `rows`; offsets = where each completion starts."""
    steps = rollout.completion_ids.shape[1]
    prompts = [rollout.prompt_ids[r] for r in rows.tolist()]
    width = max(len(p) for p in prompts) + steps
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, (r, prompt) in enumerate(zip(rows.tolist(), prompts)):
        ids[i, :len(prompt)] = torch.tensor(prompt)
        ids[i, len(prompt):len(prompt) + steps] = rollout.completion_ids[r]
        mask[i, :len(prompt) + int(rollout.mask[r].sum())] = 1
    return ids, mask, [len(p) for p in prompts]


def packed_inputs(ids: torch.Tensor, device: str = "cpu") -> dict:
    """Forward arguments for `pack`ed rows. They are right-padded, so causal attention alone keeps every
    real token from seeing padding, and default positions count from 0 on every row: with no mask, no
    position ids and no cache, transformers calls attention with `is_causal=True`, its fused kernel,
    rather than the slower masked one, which computes the same thing for every real token. (Position
    ids that repeat over the padding would read as packed sequences and bring the mask back.)"""
    return {"input_ids": ids.to(device), "use_cache": False}


@torch.no_grad()
def plain_forward_seconds(model, rollout: Rollout, micro_batch: int, device: str = "cpu") -> float:
    """Seconds for bare forwards over the same sequences: the floor rescoring is compared against."""
    from time import perf_counter

    start = perf_counter()
    for first in range(0, len(rollout.prompt_ids), micro_batch):
        rows = torch.arange(first, min(first + micro_batch, len(rollout.prompt_ids)))
        ids, _, _ = pack(rollout, rows, special_ids(model.config)[0])
        model(**packed_inputs(ids, device))
    return perf_counter() - start
