"""Thin glue around trl's GRPOTrainer: the task as a dataset, its reward, configs and QLoRA loading."""
from __future__ import annotations

import random

import torch

from . import models, task
from .profiles import Profile


def task_dataset(profile: Profile, seed: int = 0, count: int | None = None):
    """A `datasets.Dataset` of prompts (column `prompt`) and true answers (column `answer`)."""
    from datasets import Dataset

    plan = profile.grpo
    problems = task.sample_problems(random.Random(20_000 + seed), count or plan.prompts,
                                    plan.min_walk, plan.max_walk)
    return Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})


def exact_match_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """trl reward function: 1.0 per completion whose final answer is right."""
    return [task.exact_match(c, a) for c, a in zip(completions, answer)]


def config(profile: Profile, output_dir: str, seed: int = 0, steps: int | None = None, **overrides):
    """A GRPOConfig sized by the profile; `overrides` set precision flags and the rest."""
    from trl import GRPOConfig

    plan = profile.grpo
    settings = dict(
        output_dir=output_dir, max_steps=steps or plan.steps, learning_rate=plan.lr,
        per_device_train_batch_size=plan.batch_size, num_generations=plan.num_generations,
        max_completion_length=task.completion_length(plan.max_walk) + 1, temperature=1.0,
        beta=0.0, logging_steps=1, report_to="none", save_strategy="no", seed=seed, data_seed=seed,
        disable_tqdm=True, dataloader_num_workers=0,
        bf16=False, fp16=False,  # trl defaults to bf16; every chapter states its precision explicitly
        use_cpu=not torch.cuda.is_available(),
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


def trainer(model, tokenizer, args, profile: Profile, seed: int = 0, peft_config=None):
    """trl's GRPOTrainer on the task, quiet (no per-step log printing)."""
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    built = GRPOTrainer(model=model, reward_funcs=exact_match_reward, args=args,
                        train_dataset=task_dataset(profile, seed), processing_class=tokenizer,
                        peft_config=peft_config)
    built.remove_callback(PrinterCallback)
    return built


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
    from .measure import measure

    with measure(device) as cost:
        built.train()
    history = built.state.log_history
    tokens = max((entry.get("num_tokens", 0) for entry in history), default=0)
    rewards = reward_curve(built)
    return {
        "peak_mem_mb": cost.peak_mem_mb, "mem_label": cost.mem_label, "seconds": cost.seconds,
        "it_per_s": cost.rate(built.state.global_step), "tokens_per_s": cost.rate(tokens),
        "final_reward": sum(rewards[-last:]) / max(1, len(rewards[-last:])), "reward_curve": rewards,
        "grad_norm_curve": [entry["grad_norm"] for entry in history if "grad_norm" in entry],
    }
