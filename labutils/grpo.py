"""Thin glue around trl's GRPOTrainer: the task as a dataset, its reward, configs and QLoRA loading."""
from __future__ import annotations

import random

import torch

from . import mismatch, models, task
from .profiles import GrpoPlan, Profile


def task_dataset(profile: Profile, seed: int = 0, count: int | None = None, plan: GrpoPlan | None = None,
                 exclude: frozenset = frozenset()):
    """A `datasets.Dataset` of prompts (column `prompt`) and true answers (column `answer`).

    Problems in `exclude` (held-out evaluation problems) are never trained on.
    """
    from datasets import Dataset

    plan = plan or profile.grpo
    problems = task.sample_problems(random.Random(20_000 + seed), count or plan.prompts,
                                    plan.min_walk, plan.max_walk, exclude=exclude)
    return Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})


def exact_match_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """trl reward function: 1.0 per completion whose final answer is right."""
    return [task.exact_match(c, a) for c, a in zip(completions, answer)]


def config(profile: Profile, output_dir: str, seed: int = 0, steps: int | None = None,
           plan: GrpoPlan | None = None, **overrides):
    """A GRPOConfig sized by the profile (or `plan`); `overrides` set precision flags and the rest."""
    from trl import GRPOConfig

    plan = plan or profile.grpo
    settings = dict(
        output_dir=output_dir, max_steps=steps or plan.steps, learning_rate=plan.lr,
        per_device_train_batch_size=plan.batch_size, num_generations=plan.num_generations,
        max_completion_length=task.completion_length(plan.max_walk) + 1, temperature=1.0,
        beta=0.0, logging_steps=1, report_to="none", save_strategy="no", seed=seed, data_seed=seed,
        disable_tqdm=True, dataloader_num_workers=0,
        bf16=False, fp16=False,  # trl defaults to bf16; every chapter states its precision explicitly
        vllm_importance_sampling_correction=False,  # on by default in trl; chapters turn it on by name
        use_cpu=profile.device == "cpu",
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


def load_4bit(profile: Profile, seed: int = 0, model_id: str | None = None,
              compute_dtype: torch.dtype = torch.float32):
    """The dense model quantized to 4-bit NF4 with bitsandbytes; returns (model, tokenizer)."""
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=compute_dtype)
    return models.load(model_id, kind="dense", profile=profile, seed=seed, dtype=compute_dtype,
                       quantization_config=quantization)


def lora_config(profile: Profile):
    """The LoRA adapters trained on top of the frozen (quantized) weights."""
    from peft import LoraConfig

    return LoraConfig(r=profile.grpo.lora_rank, lora_alpha=2 * profile.grpo.lora_rank, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      task_type="CAUSAL_LM")


def reward_curve(trainer) -> list[float]:
    """Mean reward per logged step, from the trainer's log history."""
    return [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]


def trainer(model, tokenizer, args, profile: Profile, seed: int = 0, peft_config=None, plan: GrpoPlan | None = None,
            trainer_class=None, exclude: frozenset = frozenset(), **extra):
    """trl's GRPOTrainer (or `trainer_class`) on the task, quiet (no per-step log printing)."""
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    built = (trainer_class or GRPOTrainer)(model=model, reward_funcs=exact_match_reward, args=args,
                                           train_dataset=task_dataset(profile, seed, plan=plan, exclude=exclude),
                                           processing_class=tokenizer, peft_config=peft_config, **extra)
    built.remove_callback(PrinterCallback)
    return built


def precision_flags(train_dtype: torch.dtype, device: str) -> dict:
    """GRPOConfig flags for a training engine in `train_dtype`: accelerate's mixed precision on a GPU
    (with its loss scaler for fp16); none on a CPU, where accelerate ignores them."""
    if device != "cuda" or train_dtype == torch.float32:
        return {}
    return {"fp16": True} if train_dtype == torch.float16 else {"bf16": True}


def cast_trainables(model, dtype: torch.dtype) -> int:
    """Cast every trainable parameter to `dtype` (public-API step after building a trainer); returns how many."""
    count = 0
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(dtype)
            count += 1
    return count


def train_measured(built, device: str, last: int = 4) -> dict:
    """Train, and return peak memory, it/s, tokens/s, final reward (mean of the last steps) and curves."""
    import gc

    from .measure import measure

    # Trainer.train() begins with a full gc.collect() (accelerate's free_memory), which walks every object the
    # process holds (up to a second per run on a CPU); frozen ones are skipped, and unfrozen again after training.
    # A process forked from a warm server has its libraries frozen already: unfreezing would thaw them too.
    thaw = gc.get_freeze_count() == 0
    if thaw:
        gc.freeze()
    try:
        with measure(device) as cost:
            built.train()
    finally:
        if thaw:
            gc.unfreeze()
    history = built.state.log_history
    tokens = max((entry.get("num_tokens", 0) for entry in history), default=0)
    rewards = reward_curve(built)
    return {
        "peak_mem_mb": cost.peak_mem_mb, "mem_label": cost.mem_label, "seconds": cost.seconds,
        "peak_reserved_mb": cost.peak_reserved_mb,
        "it_per_s": cost.rate(built.state.global_step), "tokens_per_s": cost.rate(tokens),
        "final_reward": sum(rewards[-last:]) / max(1, len(rewards[-last:])), "reward_curve": rewards,
        "grad_norm_curve": [entry["grad_norm"] for entry in history if "grad_norm" in entry],
    }


def qlora_trainer(profile: Profile, output_dir: str, compute_dtype: torch.dtype, seed: int = 0,
                  steps: int | None = None, model_id: str | None = None, **precision):
    """A fresh 4-bit NF4 model with LoRA adapters in trl's GRPOTrainer; `precision` sets fp16/bf16."""
    torch.manual_seed(seed)
    model, tokenizer = load_4bit(profile, seed=seed, model_id=model_id, compute_dtype=compute_dtype)
    args = config(profile, output_dir, seed=seed, steps=steps, **precision)
    return trainer(model, tokenizer, args, profile, seed=seed, peft_config=lora_config(profile))


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LoraDtypeProbe:
    """Forward hooks on the first LoRA layer: the dtypes its frozen base path and its adapter path compute in.

    peft's LoRA layer calls the base layer on the input as given, then casts the input to the
    adapter's dtype before lora_A; the hooks read what each path really received and returned.
    """

    def __init__(self, model):
        layer = next(m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer") and len(m.lora_A))
        adapter = next(iter(layer.lora_A.values()))
        self.seen: dict[str, set[str]] = {}
        self.handles = [layer.base_layer.register_forward_hook(self._note("base")),
                        adapter.register_forward_hook(self._note("lora"))]

    def _note(self, path: str):
        def hook(module, inputs, output):
            self.seen.setdefault(f"{path}_input", set()).add(_dtype_name(inputs[0].dtype))
            self.seen.setdefault(f"{path}_output", set()).add(_dtype_name(output.dtype))
        return hook

    def dtypes(self) -> dict[str, str]:
        """{'base_input': 'float32', 'lora_input': 'bfloat16', ...}, comma-joined where several were seen."""
        return {key: ",".join(sorted(values)) for key, values in sorted(self.seen.items())}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def trainable_dtypes(model) -> str:
    """The dtypes of a model's trainable parameters, comma-joined."""
    return ",".join(sorted({_dtype_name(p.dtype) for p in model.parameters() if p.requires_grad}))


def optimizer_state_dtypes(optimizer) -> str:
    """The dtypes of the tensors an optimizer keeps per parameter (Adam's moments), comma-joined ('' before a step)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if inner is None:
        return ""
    return ",".join(sorted({_dtype_name(value.dtype) for state in inner.state.values() for key, value in state.items()
                            if torch.is_tensor(value) and key != "step"}))


def accelerate_precision(built) -> dict:
    """What accelerate made of a trainer's fp16/bf16 flags, read off the live Accelerator."""
    accelerator = built.accelerator
    return {"mixed_precision": accelerator.mixed_precision, "autocast": accelerator.native_amp,
            "scaler_class": type(accelerator.scaler).__name__ if accelerator.scaler is not None else "none"}


def qlora_fix_run(profile: str, output_dir: str, compute_dtype: str, precision: dict, cast_to: str | None,
                  seed: int = 0, steps: int | None = None, model_id: str | None = None) -> dict:
    """Build, audit and train one QLoRA precision fix; a JSON-able record, meant for `measure.forked_runs`.

    Records what accelerate built, the trainables as trl left them and after `cast_to`, the dtypes the
    LoRA layer computed in, the Adam state, the preflight findings for a bf16-capable GPU, cost and rewards.
    On a CPU `peak_mem_mb` is the process's peak RSS (so: one process per fix); on CUDA, max allocated.
    """
    from . import measure, preflight
    from .profiles import check_parameters

    chosen = check_parameters(profile, seed)
    built = qlora_trainer(chosen, output_dir, getattr(torch, compute_dtype), seed=seed, steps=steps,
                          model_id=model_id, **precision)
    record = {**accelerate_precision(built), "trainables_built": trainable_dtypes(built.model)}
    if cast_to:
        cast_trainables(built.model, getattr(torch, cast_to))
    record["trainables"] = trainable_dtypes(built.model)
    state = [*built.model.parameters(), *built.model.buffers()]
    record["model_mb"] = sum(t.numel() * t.element_size() for t in state) / 2**20  # 4-bit weights count packed
    record["preflight_findings"] = [f.code for f in preflight.check(built.model, built.args, device="cuda",
                                                                   capability=(8, 0))]
    probe = LoraDtypeProbe(built.model)
    record["rss_before_train_mb"] = measure.rss_mb()
    try:
        record.update(train_measured(built, chosen.device))
        record["error"] = "none"
    except RuntimeError as err:  # on CUDA a misconfigured fix crashes here; the record says how
        nan = float("nan")
        record.update(error=str(err).splitlines()[0], reward_curve=[], grad_norm_curve=[], final_reward=nan,
                      seconds=nan, it_per_s=nan, tokens_per_s=nan, peak_mem_mb=nan, peak_reserved_mb=nan,
                      mem_label="")
    probe.remove()
    record.update(probe.dtypes(), adam_state=optimizer_state_dtypes(built.optimizer),
                  steps_done=built.state.global_step)
    if chosen.device == "cpu":
        record.update(peak_mem_mb=measure.process_peak_rss_mb(), mem_label="process peak RSS (VmHWM)")
    return record


class EngineRollout:
    """A trl `rollout_func`: completions sampled by an InferenceEngine, weights synced every step.

    It returns the sampled tokens' log μ, which trl carries as `sampling_per_token_logps`.
    """

    def __init__(self, engine, max_new_tokens: int, temperature: float = 1.0, seed: int = 0):
        self.engine, self.max_new_tokens, self.temperature = engine, max_new_tokens, temperature
        self.generator = torch.Generator(engine.device).manual_seed(seed)
        self.synced_step = None
        self.samples: list = []  # every Rollout, for the chapter to inspect

    def __call__(self, prompts: list[str], trainer) -> dict:
        if trainer.state.global_step != self.synced_step:  # the weight sync after each optimizer step
            self.engine.sync(trainer.accelerator.unwrap_model(trainer.model))
            self.synced_step = trainer.state.global_step
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        out = self.engine.sample(prompt_ids, self.max_new_tokens, temperature=self.temperature,
                                 generator=self.generator)
        self.samples.append(out)
        return {"prompt_ids": prompt_ids, "completion_ids": out.completions(), "logprobs": out.token_logprobs()}


def _engine_trainer_class():
    from trl import GRPOTrainer

    class EngineGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with a training engine in `train_dtype` and trl's IS options applied to rollout_func log-probs.

        The training engine's precision is autocast around every loss forward (trainer's public
        `autocast_smart_context_manager` hook): weights and optimizer stay fp32, the forward's matrix products
        run in `train_dtype` and its residual stream stays fp32, as under accelerate's mixed precision (torch
        AMP). verl's FSDP actor and DeepSpeed's bf16 mode cast the parameters instead, so their whole forward
        runs in that dtype (chapter 4b's pure-dtype `rollout.TrainingEngine` computes so). trl applies its importance-sampling
        correction (`vllm_importance_sampling_*`) only to vLLM rollouts; here the same options are
        applied to the inference engine's log-probs by weighting the advantages per token.
        """

        def __init__(self, *args, train_dtype: torch.dtype = torch.float32, **kwargs):
            self.train_dtype = train_dtype
            super().__init__(*args, **kwargs)
            self.logits_dtypes: set[str] = set()
            self.own_loss_scaler = None  # set by add_loss_scaler where accelerate built none
            self.model.get_decoder().register_forward_hook(self._note_logits_dtype)

        def add_loss_scaler(self, init_scale: float = 2.0**16):
            """Give an fp16 engine the loss scaler accelerate builds only off the CPU; returns the scaler in use.

            accelerate's `backward` scales the loss with `accelerator.scaler`, and the optimizer wrapper
            it builds in `prepare` (inside `train()`) steps through it: it skips a step whose gradients
            hold inf/NaN and updates the scale. accelerate unscales before clipping only in its own fp16
            mode, so `training_step` does that here. bf16 and fp32 engines get none (nothing to underflow).
            """
            if self.train_dtype != torch.float16 or self.accelerator.scaler is not None:
                return self.accelerator.scaler
            self.own_loss_scaler = torch.amp.GradScaler(self.accelerator.device.type, init_scale=init_scale)
            self.accelerator.scaler = self.own_loss_scaler
            return self.own_loss_scaler

        def training_step(self, model, inputs, num_items_in_batch=None):
            # an fp16 engine's scaler: ours on a CPU, accelerate's own off it (built for fp16 on CUDA)
            scaler = self.accelerator.scaler if self.train_dtype == torch.float16 else None
            if scaler is not None:  # the scale this step's backward uses; a drop at the next step marks a skipped step
                self._metrics["train"]["loss_scale"].append(scaler.get_scale())
            loss = super().training_step(model, inputs, num_items_in_batch)
            if scaler is not None and scaler is self.own_loss_scaler and self.accelerator.sync_gradients:
                # true gradients before the trainer clips them and logs their norm (accelerate's own fp16 mode
                # unscales in its clip_grad_norm_); the step then reuses found_inf
                scaler.unscale_(getattr(self.optimizer, "optimizer", self.optimizer))
            return loss

        def _note_logits_dtype(self, module, inputs, output):
            """Record the dtype trl's fused LM head computes the loss's logits in.

            trl's chunked log-prob kernel multiplies the backbone's last hidden state by the LM head
            in the autocast dtype when autocast is on, else in the hidden state's own dtype.
            """
            if module.training and torch.is_grad_enabled():  # the forward whose logits enter the loss
                kind = output.last_hidden_state.device.type
                dtype = (torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind)
                         else output.last_hidden_state.dtype)
                self.logits_dtypes.add(str(dtype).removeprefix("torch."))

        def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
            if self.train_dtype == torch.float32:
                return super().autocast_smart_context_manager(cache_enabled)
            return torch.autocast(self.accelerator.device.type, dtype=self.train_dtype, cache_enabled=cache_enabled)

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            mu = output.get("sampling_per_token_logps")
            if mu is None:
                return output
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            mask = output["completion_mask"].float()
            with torch.no_grad(), self.compute_loss_context_manager():  # π as the training engine sees it
                pi, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, attention, output["completion_ids"].size(1), batch_size=ids.size(0))
            lr = mismatch.log_ratio(pi.float(), mu.float(), mask)
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["mismatch/k3"].append(mismatch.k3(lr, mask))
            self._metrics[mode]["mismatch/max_abs_log_ratio"].append(float(lr.abs().max()))
            for key, value in importance_health(lr, mask).items():  # logged whether or not a correction is on
                self._metrics[mode][f"is/{key}"].append(value)
            if self.args.vllm_importance_sampling_correction:
                weight = importance_weights(lr, mask, self.args.vllm_importance_sampling_mode,
                                            self.args.vllm_importance_sampling_clip_min,
                                            self.args.vllm_importance_sampling_clip_max)
                self._metrics[mode]["mismatch/is_weight_mean"].append(float((weight * mask).sum() / mask.sum()))
                self._metrics[mode]["is/corrected_fraction"].append(
                    corrected_fraction(lr, mask, weight, self.args.vllm_importance_sampling_mode))
                advantages = output["advantages"]
                output["advantages"] = (advantages[:, None] if advantages.dim() == 1 else advantages) * weight
            return output

    return EngineGRPOTrainer


def engine_trainer_class():
    """The EngineGRPOTrainer class itself (built on first use, so importing labutils does not import trl)."""
    return _engine_trainer_class()


def gradient_snapshot(step: int = 0):
    """A TrainerCallback keeping a copy of every trainable gradient just before optimizer step `step` (0: the first).

    Two runs with the same seed sample the same first batch from the same weights, so their first
    gradients differ only by how they were computed (e.g. fp16 with and without a loss scaler).
    """
    from transformers import TrainerCallback

    class GradientSnapshot(TrainerCallback):
        def __init__(self):
            self.grads: dict[str, torch.Tensor] = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == step:
                self.grads = {name: p.grad.detach().float().cpu().clone() for name, p in model.named_parameters()
                              if p.requires_grad and p.grad is not None}

    return GradientSnapshot()


def flushed_fraction(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Share of the gradient entries nonzero in `reference` that are exactly zero in `grads`."""
    nonzero = sum(int((reference[k] != 0).sum()) for k in reference)
    flushed = sum(int(((grads[k] == 0) & (reference[k] != 0)).sum()) for k in reference)
    return flushed / nonzero if nonzero else float("nan")


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str,
                       clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """Per-token weights π/μ with trl's modes: token_/sequence_ truncate (clip) or mask (zero outside).

    Weights are detached: they rescale each token's share of the gradient, as in TIS and MIS.
    """
    level, rule = mode.split("_")
    ratio = log_ratio.sum(-1, keepdim=True) if level == "sequence" else log_ratio
    ratio = ratio.detach().exp()
    low = clip_min if clip_min is not None else (0.0 if rule == "truncate" else -float("inf"))
    high = clip_max if clip_max is not None else float("inf")
    if rule == "truncate":
        ratio = ratio.clamp(min=low, max=high)
    elif rule == "mask":
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    else:
        raise ValueError(f"importance-sampling mode {mode!r} is not one of trl's: "
                         "token_truncate, token_mask, sequence_truncate, sequence_mask.")
    return ratio.expand_as(log_ratio) * mask


def importance_health(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict:
    """How usable the raw weights π/μ of one batch are, token- and sequence-level (as verl logs them).

    Under samples from μ, E_μ[π/μ] = 1 exactly, at every length, so a mean far from 1 is sampling
    noise from a heavy tail. χ² = E_μ[(π/μ − 1)²] is the weight's variance; the effective sample
    size (Σw)² / (N·Σw²), as a fraction of N, says how many sequences the weighted batch is worth.
    """
    tokens = (log_ratio.double().exp() - 1) * mask
    count = mask.sum()
    sequence = mismatch.sequence_log_ratio(log_ratio, mask).double().exp()
    return {"token_weight_mean": float(1 + tokens.sum() / count), "token_chi2": float(tokens.square().sum() / count),
            "seq_weight_mean": float(sequence.mean()), "seq_chi2": float((sequence - 1).square().mean()),
            "ess": float(sequence.sum().square() / (len(sequence) * sequence.square().sum()))}


def corrected_fraction(log_ratio: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor, mode: str) -> float:
    """Share of tokens (token modes) or sequences (sequence modes) whose weight truncation or masking changed."""
    raw = (mismatch.sequence_log_ratio(log_ratio, mask)[:, None] if mode.startswith("sequence") else log_ratio).exp()
    changed = ((weight - raw.expand_as(weight)).abs() > 1e-6 * raw.expand_as(weight)) & mask.bool()
    if mode.startswith("sequence"):
        return float(changed.any(-1).float().mean())
    return float(changed.sum() / mask.sum())


def engine_trainer(model, tokenizer, args, profile: Profile, rollout_func, train_dtype: torch.dtype,
                   seed: int = 0, plan: GrpoPlan | None = None, peft_config=None, exclude: frozenset = frozenset()):
    """An EngineGRPOTrainer on the task, quiet; completions come from `rollout_func` (None: trl's own generate)."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in trl
    return trainer(model, tokenizer, args, profile, seed, peft_config, plan, trainer_class=_engine_trainer_class(),
                   exclude=exclude, rollout_func=rollout_func, train_dtype=train_dtype)


def routing_probe(prompt_ids: list[list[int]], lengths: torch.Tensor, dtype: torch.dtype, every: int,
                  device: str = "cpu", seed: int = 0):
    """A TrainerCallback that, every `every` steps, samples a fixed probe set with fresh engines at
    `dtype` from the current weights and records the routing flip rate and the token KL."""
    from transformers import TrainerCallback

    from . import mismatch, moe, rollout

    class RoutingProbe(TrainerCallback):
        def __init__(self):
            self.history: list[dict] = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every and state.global_step != state.max_steps:
                return
            was_training = model.training
            sampled = rollout.InferenceEngine(model, dtype, device).sample(
                prompt_ids, lengths, lengths, keep_vocab=True, keep_experts=True,
                generator=torch.Generator(device).manual_seed(seed))
            scored = rollout.TrainingEngine(model, dtype, device).score(sampled, keep_vocab=True, keep_experts=True)
            self.history.append({"step": state.global_step,
                                 "flip_rate": moe.flip_rate(sampled.experts, scored.experts, sampled.mask),
                                 "token_kl": mismatch.summary(sampled, scored.logprobs, scored.vocab)["token_kl"]})
            model.train(was_training)

    return RoutingProbe()
