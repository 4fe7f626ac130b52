"""Chapter 2's QLoRA precision fixes on the real model, trained on a task it can do.

The lab's walk task is foreign to a pretrained chat model: every completion earns 0, so every group's
advantage and every update is 0. Here each fix trains on `real_rl`'s "Repeat this number exactly"
task, which SmolLM2-135M-Instruct answers right part of the time, so the reward and the update are
not 0. Its speed leaves the first step out: that one pays once for kernel selection, the allocator's
growth and lazy imports, and says nothing about the steps after it.
"""
from __future__ import annotations

import time

import torch

from . import grpo, real_rl


class StepClock:
    """A trl/transformers callback: the wall-clock time at the end of every optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                clock.ends.append(time.perf_counter())

        self.started = float("nan")
        self.ends: list[float] = []
        self.callback = _Callback()

    def rate_after_first(self, count_per_step: list[float] | None = None) -> float:
        """Steps per second (or `count_per_step` summed over the later steps, per second) after the
        first step; NaN with fewer than two steps."""
        if len(self.ends) < 2:
            return float("nan")
        later = (count_per_step[1:len(self.ends)] if count_per_step is not None
                 else [1.0] * (len(self.ends) - 1))
        return sum(later) / (self.ends[-1] - self.ends[0])


def repeat_dataset(tokenizer, count: int, seed: int):
    """`count` chat-formatted Repeat prompts (column `prompt`) and their numbers (column `answer`)."""
    from datasets import Dataset

    numbers = real_rl.problems(count, seed)
    return Dataset.from_dict({"prompt": [real_rl.prompt_text(tokenizer, n) for n in numbers],
                              "answer": numbers})


def fix_run(profile: str, output_dir: str, compute_dtype: str, precision: dict, cast_to: str | None,
            seed: int = 0, steps: int | None = None, model_id: str | None = None,
            prompts: int = 64) -> dict:
    """Build, audit and train one QLoRA fix on the Repeat task; a JSON-able record, for
    `measure.forked_runs`. `precision` holds GRPOConfig's flags and sizes.

    Records what trl left the trainables as and what was trained, the model's own state, the process
    memory before and at the peak of training, speed after the first step, and the rewards.
    """
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from . import measure
    from .profiles import check_parameters

    chosen = check_parameters(profile, seed)
    torch.manual_seed(seed)
    model, tokenizer = grpo.load_4bit(chosen, seed=seed, model_id=model_id,
                                      compute_dtype=getattr(torch, compute_dtype))
    if getattr(tokenizer, "chat_template", None):
        task, data, reward = "repeat", repeat_dataset(tokenizer, prompts, seed), real_rl.reward
    else:  # the lab's toy (a GPU machine without the real model's file): its own walk task
        task, data, reward = "walk", grpo.task_dataset(chosen, seed), grpo.exact_match_reward
    args = grpo.config(chosen, output_dir, seed=seed, steps=steps, **precision)
    built = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                        processing_class=tokenizer, peft_config=grpo.lora_config(chosen))
    built.remove_callback(PrinterCallback)
    record = {"task": task, **grpo.accelerate_precision(built),
              "trainables_built": grpo.trainable_dtypes(built.model)}
    if cast_to:
        grpo.cast_trainables(built.model, getattr(torch, cast_to))
    record["trainables"] = grpo.trainable_dtypes(built.model)
    state = [*built.model.parameters(), *built.model.buffers()]
    record["model_mb"] = sum(t.numel() * t.element_size() for t in state) / 2**20  # 4-bit counts packed
    clock = StepClock()
    built.add_callback(clock.callback)
    record["rss_before_train_mb"] = measure.rss_mb()
    try:
        record.update(grpo.train_measured(built, chosen.device, last=max(1, built.args.max_steps)))
        record["error"] = "none"
    except RuntimeError as err:  # on CUDA a misconfigured fix crashes here; the record says how
        nan = float("nan")
        record.update(error=str(err).splitlines()[0], reward_curve=[], final_reward=nan, seconds=nan,
                      peak_mem_mb=nan, peak_reserved_mb=nan, mem_label="")
    history = built.state.log_history
    tokens = [e["num_tokens"] for e in history if "num_tokens" in e]  # cumulative, per logged step
    per_step = [b - a for a, b in zip([0.0, *tokens], tokens)]
    zero_std = [e["frac_reward_zero_std"] for e in history if "frac_reward_zero_std" in e]
    record.update(steps_done=built.state.global_step, timed_steps=max(0, len(clock.ends) - 1),
                  first_step_s=clock.ends[0] - clock.started if clock.ends else float("nan"),
                  it_per_s=clock.rate_after_first(), tokens_per_s=clock.rate_after_first(per_step),
                  groups_all_same_reward=sum(zero_std) / len(zero_std) if zero_std else float("nan"),
                  adam_state=grpo.optimizer_state_dtypes(built.optimizer))
    if chosen.device == "cpu":
        record.update(peak_mem_mb=measure.process_peak_rss_mb(), mem_label="process peak RSS (VmHWM)")
    return record
