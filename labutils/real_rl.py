"""RL on the real model: trl GRPO with the engines' rollout, trainer and sampler in one precision.

The task is one SmolLM2-135M-Instruct can do some of the time: "Repeat this number exactly: N",
N from 10 to 999, scored on the first integer of the answer. A random well-formed answer (any
number of that range) succeeds about 0.1% of the time; the model's own success and well-formed rates
at the RL temperature are measured by every run at step 0 (`eval[0]`, `well_formed[0]`).

Pairs as in Qi et al.: `bf16_bf16` and `fp16_fp16` (sampler and trainer both in that precision, the
trainer under autocast with fp32 master weights), `fp32_fp32` the control. Every step logs the
trainer–sampler k3, χ² and ESS (`grpo.EngineGRPOTrainer`); the trained policy's held-out accuracy is
sampled from its fp32 weights at the RL temperature every `eval_every` steps.

The long run (`make long-real`, `python -m labutils.real_rl`) writes results/long/real_rl.json with the
fingerprint of the modules it runs and of the model; a chapter refuses a file whose fingerprint does
not match.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch

from . import env, grpo, models, rollout
from .profiles import RealRlPlan
from .sampling_speed import model_fingerprint  # the converted model's folder name, as chapter 4b's speed run

TARGET = Path(__file__).resolve().parent.parent / "results" / "long" / "real_rl.json"

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


def _evaluator(numbers, tokenizer, temperature, max_new_tokens, every, seed, device):
    from transformers import TrainerCallback

    class HeldOut(TrainerCallback):
        def __init__(self):
            self.history: list[tuple[int, dict]] = []

        def _score(self, state, model):
            was_training = model.training
            model.eval()
            self.history.append((state.global_step, accuracy(model, tokenizer, numbers, temperature,
                                                             max_new_tokens, seed, device)))
            model.train(was_training)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self._score(state, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self._score(state, model)

    return HeldOut()


def run(pair: str, profile, steps: int, prompts_per_step: int, group: int, lr: float, max_new_tokens: int,
        eval_numbers: list[int], eval_every: int, output_dir: str, model_id: str, seed: int = 0,
        temperature: float = 1.0, train_prompts: int = 512) -> dict:
    """One GRPO run of `pair` on the real model; its per-step curves and held-out accuracy history."""
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
    held_out = _evaluator(eval_numbers, tokenizer, temperature, max_new_tokens, eval_every, seed, profile.device)
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
            "well_formed": [e["well_formed"] for _, e in held_out.history]}


# the committed run's size, fixed before it ran: 60 s per fp16 step on a 2-core CPU (fp16 has no fast CPU
# kernels), about 12 s for bf16 and fp32
LONG = RealRlPlan(steps=30, prompts_per_step=2, group=4, lr=1e-5, max_new_tokens=12, eval_problems=64,
                  eval_every=10)


def code_fingerprint() -> str:
    """A hash of this module and of the labutils modules it runs."""
    from .long_run import modules_run

    folder = Path(__file__).parent
    digest = hashlib.sha256()
    for module in modules_run("real_rl"):
        if module != "profiles":
            digest.update(module.encode() + b"\0" + (folder / f"{module}.py").read_bytes())
    return digest.hexdigest()[:16]


def stale(payload: dict) -> str | None:
    """Why a committed long run cannot be read by this checkout (one sentence), or None."""
    made = payload.get("provenance", {})
    if made.get("code") != code_fingerprint() or made.get("model") != model_fingerprint():
        return ("The committed real-model RL run was made by other code or another model than this checkout's: "
                "run `make long-real` and commit its file.")
    return None


def load(target: Path = TARGET) -> tuple[dict | None, str | None]:
    """The committed long run and, where it cannot be used, why."""
    if not target.is_file():
        return None, "No long run is committed yet (`make long-real` makes one), so the question stays open."
    payload = json.loads(target.read_text())
    return payload, stale(payload)


def run_plan(plan: RealRlPlan, profile, output_dir: str, model_id: str, pairs=PAIRS, progress=print) -> dict:
    """Every pair at every seed of `plan`, on the same held-out numbers."""
    eval_numbers = problems(plan.eval_problems, seed=0)
    runs = {}
    for pair in pairs:
        for seed in range(plan.seeds):
            result = run(pair, profile, plan.steps, plan.prompts_per_step, plan.group, plan.lr, plan.max_new_tokens,
                         eval_numbers, plan.eval_every, output_dir, model_id, seed=seed,
                         temperature=plan.temperature)
            runs.setdefault(pair, []).append(result)
            progress(f"{pair} seed {seed}: k3 {result['k3'][0]:.2g} → {result['k3'][-1]:.2g}, held-out "
                     f"{result['eval'][0]:.2f} → {result['eval'][-1]:.2f} ({result['seconds']:.0f} s)")
    return runs


def main(argv: list[str] | None = None) -> None:
    import tempfile

    from . import pretrained, profiles

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=TARGET)
    args = parser.parse_args(argv)
    began = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        runs = run_plan(LONG, profiles.PROFILES["cpu"], scratch, pretrained.NAME)
    payload = {"plan": asdict(LONG), "task": PROMPT, "runs": runs, "minutes": (time.time() - began) / 60,
               "provenance": {"code": code_fingerprint(), "model": model_fingerprint(),
                              "date": time.strftime("%Y-%m-%d", time.gmtime(began)), "cpu": env.cpu_model(),
                              "kernel_set": env.kernel_set(), "torch_threads": torch.get_num_threads(),
                              "env": env.env_report()}}
    args.target.parent.mkdir(parents=True, exist_ok=True)
    args.target.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.target}")


if __name__ == "__main__":
    main()
