"""RL on the real model: trl GRPO with the engines' rollout, trainer and sampler in one precision.

The task is one SmolLM2-135M-Instruct can do some of the time: "Repeat this number exactly: N",
N from 10 to 999, scored on the first integer of the answer. A random well-formed answer (any
number of that range) succeeds about 0.1% of the time; the model's own success and well-formed rates
at the RL temperature are measured by every run at step 0 (`eval[0]`, `well_formed[0]`).

Pairs as in Qi et al.: `bf16_bf16` and `fp16_fp16` (sampler and trainer both in that precision, the
trainer under autocast with fp32 master weights), `fp32_fp32` the control. Every step logs the
trainer–sampler k3, χ² and ESS (`grpo.EngineGRPOTrainer`); the trained policy's held-out accuracy is
sampled from its fp32 weights at the RL temperature every `eval_every` steps. One batch's k3 is too
noisy to show a trend, so at the same steps a fixed probe (`probe`) measures the mismatch exactly over
the vocabulary on fixed prompts, with the policy's drift from its start beside it.

The long run (`make long-real`, `python -m labutils.real_rl`) first picks the learning rate on the
fp32 control (`choose_lr`), then runs every pair at it, and writes results/long/real_rl.json through
`labutils.committed`: the fingerprint of the modules it runs, of its plan and of the model (the library
versions are in its provenance); a chapter refuses a file whose fingerprint does not match.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from . import committed, grpo, mismatch, models, rollout
from .profiles import RealRlPlan


PAIRS = ("fp32_fp32", "bf16_bf16", "fp16_fp16")
PROMPT = "Repeat this number exactly: {n}"
LOW, HIGH = 10, 999
FIRST_INTEGER = re.compile(r"-?\d+")


def problems(count: int, seed: int, exclude: frozenset = frozenset()) -> list[int]:
    """`count` distinct numbers to repeat, none of them in `exclude`."""
    pool = [n for n in range(LOW, HIGH + 1) if n not in exclude]
    if count > len(pool):
        raise ValueError(f"count={count} exceeds the {len(pool)} numbers left to draw from; ask for fewer.")
    return random.Random(seed).sample(pool, count)


def prompt_text(tokenizer, n: int) -> str:
    """The chat-formatted request for `n`, ready for the engines (no further special tokens)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": PROMPT.format(n=n)}],
                                         add_generation_prompt=True, tokenize=False)


def first_integer(text: str) -> int | None:
    found = FIRST_INTEGER.search(text)
    return int(found.group()) if found else None


def reward(completions: list[str], answer: list[int], **_) -> list[float]:
    """trl reward function: 1.0 where the answer's first integer is the number asked for."""
    return [float(first_integer(c) == a) for c, a in zip(completions, answer)]


def accuracy(model, tokenizer, numbers: list[int], temperature: float, max_new_tokens: int,
             seed: int = 0, device: str = "cpu") -> dict:
    """Success and well-formed rates of `model`'s own samples (fp32) on `numbers` at `temperature`."""
    engine = rollout.InferenceEngine(model, torch.float32, device)
    ids = [tokenizer(prompt_text(tokenizer, n), add_special_tokens=False)["input_ids"] for n in numbers]
    out = engine.sample(ids, max_new_tokens, temperature=temperature,
                        generator=torch.Generator(device).manual_seed(seed))
    answers = [first_integer(t) for t in tokenizer.batch_decode(out.completions(), skip_special_tokens=True)]
    return {"accuracy": sum(a == n for a, n in zip(answers, numbers)) / len(numbers),
            "well_formed": sum(a is not None for a in answers) / len(numbers)}


def probe(model, start, ids: list[list[int]], dtype: torch.dtype, temperature: float, max_new_tokens: int,
          seed: int = 0, device: str = "cpu") -> dict:
    """The pair's mismatch and the policy's drift on fixed prompts, exact over the vocabulary, per sequence.

    The sampler (the `dtype` engine, weights cast whole) draws one completion per prompt from a fixed
    seed, keeping log μ of the whole vocabulary; the trainer scores the same tokens as it trains, under
    autocast over the fp32 weights. Per token: KL(μ‖π) is the mismatch, and KL(π_fp32‖π_0) against
    `start` (a TrainingEngine holding the policy before training) the drift; each is averaged over a
    sequence's tokens, so sequences are the independent units of its standard error.
    """
    out = rollout.InferenceEngine(model, dtype, device).sample(
        ids, max_new_tokens, temperature=temperature, generator=torch.Generator(device).manual_seed(seed),
        keep_vocab=True)
    fp32 = rollout.TrainingEngine(model, torch.float32, device)
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        trainer = fp32.score(out, temperature, keep_vocab=True).vocab
    policy = trainer if dtype == torch.float32 else fp32.score(out, temperature, keep_vocab=True).vocab
    mask = out.mask.float()

    def per_sequence(kl):
        return ((kl.float() * mask).sum(1) / mask.sum(1)).tolist()

    return {"mismatch": per_sequence(mismatch.token_kl(out.vocab_logprobs, trainer)),
            "drift": per_sequence(mismatch.token_kl(policy, start.score(out, temperature, keep_vocab=True).vocab))}


def _evaluator(numbers, tokenizer, temperature, max_new_tokens, every, seed, device, probe_numbers=(),
               dtype=torch.float32):
    from transformers import TrainerCallback

    probe_ids = [tokenizer(prompt_text(tokenizer, n), add_special_tokens=False)["input_ids"] for n in probe_numbers]

    class HeldOut(TrainerCallback):
        def __init__(self):
            self.history: list[tuple[int, dict]] = []
            self.start = None

        def _score(self, state, model):
            was_training = model.training
            model.eval()
            scores = accuracy(model, tokenizer, numbers, temperature, max_new_tokens, seed, device)
            if probe_ids:
                scores |= probe(model, self.start, probe_ids, dtype, temperature, max_new_tokens, seed, device)
            self.history.append((state.global_step, scores))
            model.train(was_training)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if probe_ids:  # the policy before training, for the drift
                self.start = rollout.TrainingEngine(model, torch.float32, device)
            self._score(state, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self._score(state, model)

    return HeldOut()


def run(pair: str, profile, steps: int, prompts_per_step: int, group: int, lr: float, max_new_tokens: int,
        eval_numbers: list[int], eval_every: int, output_dir: str, model_id: str, seed: int = 0,
        temperature: float = 1.0, train_prompts: int = 512, probe_numbers: list[int] = ()) -> dict:
    """One GRPO run of `pair` on the real model; its per-step curves, held-out accuracy history and, with
    `probe_numbers`, the probe's per-sequence mismatch and drift at the same steps."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    if pair not in PAIRS:
        raise ValueError(f"pair={pair!r} is not one of {', '.join(PAIRS)}.")
    dtype = rollout.engine_dtype(pair.split("_")[0], profile.device)
    torch.manual_seed(seed)
    model, tokenizer = models.load(model_id, kind="dense", profile=profile, device=profile.device)
    numbers = problems(train_prompts, seed + 1, exclude=frozenset(eval_numbers))
    data = Dataset.from_dict({"prompt": [prompt_text(tokenizer, n) for n in numbers], "answer": numbers})
    sampler = grpo.EngineRollout(rollout.InferenceEngine(model, dtype, profile.device), max_new_tokens,
                                 temperature=temperature, seed=seed)
    args = grpo.config(profile, f"{output_dir}/{pair}-s{seed}", seed=seed, steps=steps, plan=profile.rl,
                       learning_rate=lr, per_device_train_batch_size=prompts_per_step * group,
                       num_generations=group, max_completion_length=max_new_tokens, temperature=temperature,
                       lr_scheduler_type="constant",  # trl's linear decay would leave a short run's end untrained
                       **grpo.precision_flags(dtype, profile.device))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in trl
    trainer = grpo.engine_trainer_class()(model=model, reward_funcs=reward, args=args, train_dataset=data,
                                          processing_class=tokenizer, rollout_func=sampler, train_dtype=dtype)
    trainer.remove_callback(PrinterCallback)
    scaler = trainer.add_loss_scaler()  # fp16 only: the scaler accelerate builds off the CPU alone
    held_out = _evaluator(eval_numbers, tokenizer, temperature, max_new_tokens, eval_every, seed, profile.device,
                          probe_numbers, dtype)
    trainer.add_callback(held_out)
    start = time.perf_counter()
    trainer.train()
    history = trainer.state.log_history

    def curve(key):
        return [e[key] for e in history if key in e]

    scales = curve("loss_scale") + ([scaler.get_scale()] if scaler is not None else [])
    return {"pair": pair, "seed": seed, "seconds": time.perf_counter() - start, "reward": curve("reward"),
            "loss_scale": scales, "skipped_steps": sum(b < a for a, b in zip(scales, scales[1:])),
            "k3": curve("mismatch/k3"), "chi2": curve("is/token_chi2"), "ess": curve("is/ess"),
            "eval_steps": [s for s, _ in held_out.history],
            "eval": [e["accuracy"] for _, e in held_out.history],
            "well_formed": [e["well_formed"] for _, e in held_out.history],
            "frac_reward_zero_std": curve("frac_reward_zero_std"),  # groups that teach nothing
            "probe_mismatch": [e["mismatch"] for _, e in held_out.history if "mismatch" in e],
            "probe_drift": [e["drift"] for _, e in held_out.history if "drift" in e]}


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    return mean, (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5 if n > 1 else float("nan")


def growth(result: dict, key: str = "probe_mismatch") -> dict:
    """The probe's `key` at a run's first and last evaluation, and its change with a paired standard error
    (the same prompts and seed each time, so each sequence is compared with itself)."""
    first, last = result[key][0], result[key][-1]
    start, start_se = _mean_se(first)
    end, end_se = _mean_se(last)
    change, change_se = _mean_se([b - a for a, b in zip(first, last)])
    return {"start": start, "start_se": start_se, "end": end, "end_se": end_se, "change": change,
            "change_se": change_se}


# the committed run's size, fixed before it ran. On a 2-core CPU a step of 8 completions takes about 13 s
# in fp32 and bf16, and several times that in fp16 (this CPU has no fp16 matrix kernels), so fp16 gets one
# seed and the others more. The learning rate is the control's choice among LONG_LRS (`choose_lr`).
LONG = RealRlPlan(steps=24, prompts_per_step=2, group=4, lr=1e-5, max_new_tokens=12, eval_problems=128,
                  eval_every=6, probe_sequences=32)
LONG_LRS = (1e-4, 3e-5, 1e-5)  # tried largest first, until one holds
LONG_SEEDS = {"fp32_fp32": 2, "bf16_bf16": 3, "fp16_fp16": 1}
RUN = committed.Run("real_rl", module="real_rl", make="make long-real")
PLAN = {"long": LONG, "lrs": LONG_LRS, "seeds": LONG_SEEDS, "pairs": PAIRS, "task": PROMPT}


def load() -> tuple[dict | None, str | None]:
    """The committed long run and, where it cannot be used, why."""
    from . import pretrained

    return RUN.load(PLAN, pretrained.identity())


def run_plan(plan: RealRlPlan, profile, output_dir: str, model_id: str, pairs=PAIRS, progress=print,
             seeds: dict | None = None) -> dict:
    """Every pair at each of its seeds (`seeds`: a count or a range per pair, else `plan.seeds`), on the same
    held-out and probe numbers."""
    eval_numbers = problems(plan.eval_problems, seed=0)
    probe_numbers = eval_numbers[:plan.probe_sequences]
    runs = {}
    for pair in pairs:
        chosen = (seeds or {}).get(pair, plan.seeds)
        for seed in range(chosen) if isinstance(chosen, int) else chosen:
            result = run(pair, profile, plan.steps, plan.prompts_per_step, plan.group, plan.lr, plan.max_new_tokens,
                         eval_numbers, plan.eval_every, output_dir, model_id, seed=seed,
                         temperature=plan.temperature, probe_numbers=probe_numbers)
            runs.setdefault(pair, []).append(result)
            drift = f", probe KL {growth(result)['start']:.2g} → {growth(result)['end']:.2g}" if probe_numbers else ""
            progress(f"{pair} seed {seed} lr {plan.lr:g}: k3 {result['k3'][0]:.2g} → {result['k3'][-1]:.2g}{drift}, "
                     f"held-out {result['eval'][0]:.2f} → {result['eval'][-1]:.2f} ({result['seconds']:.0f} s)")
    return runs


def held(result: dict, key: str = "eval") -> bool:
    """Whether a run's held-out `key` rate stayed, at every evaluation, within 2 standard errors below its start."""
    n = len(problems(LONG.eval_problems, seed=0))
    start = result[key][0]
    return all(v >= start - 2 * ((start * (1 - start) + v * (1 - v)) / n) ** 0.5 for v in result[key][1:])


def choose_lr(profile, output_dir: str, model_id: str, lrs=LONG_LRS, progress=print) -> tuple[float, list[dict], dict]:
    """The regime, chosen on the fp32 control before any comparison: the largest of `lrs` at which the
    control's seed-0 run, at the comparison's full length, kept its held-out accuracy and well-formed rate
    (`held`). Returns that rate, the runs tried, and the kept run (the comparison's fp32 seed 0)."""
    pilot = []
    for lr in sorted(lrs, reverse=True):
        result = run_plan(replace(LONG, lr=lr), profile, output_dir, model_id, pairs=("fp32_fp32",),
                          progress=progress, seeds={"fp32_fp32": 1})["fp32_fp32"][0]
        ok = held(result) and held(result, "well_formed")
        pilot.append({"lr": lr, "steps": LONG.steps, "kept": ok, "eval": result["eval"],
                      "well_formed": result["well_formed"], "drift": growth(result, "probe_drift")["end"],
                      "seconds": result["seconds"]})
        if ok:
            return lr, pilot, result
    return min(lrs), pilot, result  # none held: the smallest, and the chapter says the control did not hold


def main(argv: list[str] | None = None) -> None:
    import tempfile

    from . import pretrained, profiles

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=None)
    args = parser.parse_args(argv)
    began, code = time.time(), RUN.fingerprint(PLAN)  # the code as it starts, not as it ends
    profile = profiles.PROFILES["cpu"]
    with tempfile.TemporaryDirectory() as scratch:
        lr, pilot, control = choose_lr(profile, scratch, pretrained.NAME)
        plan, runs = replace(LONG, lr=lr), {"fp32_fp32": [control]}
        for pair in PAIRS:  # the file is rewritten after each pair, marked complete after the last
            done = len(runs.get(pair, []))
            more = run_plan(plan, profile, scratch, pretrained.NAME, pairs=(pair,),
                            seeds={pair: range(done, LONG_SEEDS[pair])})
            runs[pair] = runs.get(pair, []) + more.get(pair, [])
            payload = {"chosen": asdict(plan), "seeds": LONG_SEEDS, "pilot": pilot, "task": PROMPT, "runs": runs,
                       "complete": len(runs) == len(PAIRS)}
            print(f"wrote {RUN.write(payload, PLAN, pretrained.identity(), began, args.target, code)} ({', '.join(runs)})")


if __name__ == "__main__":
    main()
