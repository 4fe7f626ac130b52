"""RL under a sampler-precision mismatch: GRPO runs whose sampler sits at a dial setting, the policy
itself evaluated as it trains, collapses counted over seeds, and the policy-gradient bias measured
without training.

The long run behind the chapter's verdict is `labutils.long_run`; what the chapter reads from the runs,
`labutils.rl_analysis`.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import random
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field

import torch

from . import grpo, models, rollout, sampler_precision, task
from .profiles import GrpoPlan, Profile

CHAPTER = "05b_sampler_precision"
TIS_CLIP = 2.0  # token-level TIS as Yao et al. run it
FIX = "tis"  # the pre-registered fix of the decisive comparison: token-level TIS, which the paper compares FP16 against


def roles(bits: int) -> dict[str, str]:
    """The runs of the decisive comparison by role, for a coarse sampler of `bits` mantissa bits."""
    return {"uncorrected": f"m{bits}", "matched": "fp32", "fix": f"m{bits}_{FIX}", "bf16": "bf16"}


@dataclass(frozen=True)
class RunSpec:
    """One RL run: the sampler's dial setting and the correction the trainer applies."""

    name: str
    sampler: str  # a sampler_precision name
    correction: dict = field(default_factory=dict)  # GRPOConfig importance-sampling options


def trl_default(option: str):
    """The installed trl's default for a GRPOConfig field (its MIS thresholds, for instance)."""
    from trl import GRPOConfig

    return next(f.default for f in dataclasses.fields(GRPOConfig) if f.name == option)


def runs_at(bits: int) -> dict[str, RunSpec]:
    """The uncorrected run with an emulated `bits`-bit sampler, the matched and bf16 baselines, and two fixes:
    token-level TIS and sequence-level MIS with trl's default thresholds."""
    coarse = f"m{bits}"

    def corrected(mode, clip_max, clip_min=None):
        return dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                    vllm_importance_sampling_clip_max=clip_max, vllm_importance_sampling_clip_min=clip_min)

    trl_max, trl_min = trl_default("vllm_importance_sampling_clip_max"), trl_default("vllm_importance_sampling_clip_min")
    specs = [RunSpec("fp32", "fp32"), RunSpec("bf16", "bf16"), RunSpec(coarse, coarse),
             RunSpec(f"{coarse}_tis", coarse, correction=corrected("token_truncate", TIS_CLIP)),
             RunSpec(f"{coarse}_mis", coarse, correction=corrected("sequence_mask", trl_max, trl_min))]
    return {s.name: s for s in specs}


def eval_problems(count: int, plan: GrpoPlan, seed: int = 0) -> list[task.Problem]:
    """Held-out problems for the policy evaluation: distinct walks of the training lengths, which the
    training dataset then excludes (pass them as `exclude` to the trainer)."""
    drawn = task.sample_problems(random.Random(30_000 + seed), count, plan.min_walk, plan.max_walk, distinct=True)
    return sorted(drawn, key=lambda p: p.steps)  # batches of like lengths: greedy decoding stops sooner


def policy_eval(problems: list[task.Problem], every: int, start: float | None = None):
    """A TrainerCallback that scores the trained policy itself (fp32, greedy) every `every` steps and at both ends;
    `start`, where given, is the score at step 0, already measured on the same weights."""
    from transformers import TrainerCallback

    class PolicyEval(TrainerCallback):
        def __init__(self):
            self.history: list[tuple[int, float]] = []

        def _score(self, state, model, processing_class):
            was_training = model.training
            model.eval()
            self.history.append((state.global_step, models.greedy_accuracy(model, processing_class, problems)))
            model.train(was_training)

        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
            if start is None:
                self._score(state, model, processing_class)
            else:
                self.history.append((state.global_step, start))

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self._score(state, model, processing_class)

    return PolicyEval()


_START_SCORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base model -> {problems: step-0 π-eval}


def train(spec: RunSpec, base_model, tokenizer, profile: Profile, plan: GrpoPlan, seed: int,
          problems: list[task.Problem], eval_every: int, output_dir: str) -> dict:
    """One GRPO run (fp32 trainer, sampler at `spec`), returning its per-step curves and π-eval history."""
    torch.manual_seed(seed)
    model = copy.deepcopy(base_model)
    device = profile.device
    engine = sampler_precision.engine(model, spec.sampler, device)
    sampler = grpo.EngineRollout(engine, max_new_tokens=task.completion_length(plan.max_walk) + 1, seed=seed)
    args = grpo.config(profile, f"{output_dir}/{spec.name}-s{seed}", seed=seed, plan=plan, **spec.correction)
    trainer = grpo.engine_trainer(model, tokenizer, args, profile, sampler, torch.float32, seed=seed, plan=plan,
                                  exclude=frozenset(problems))  # π-eval problems are never trained on
    known, key = _START_SCORES.setdefault(base_model, {}), tuple(problems)  # every run from it starts there
    evaluator = policy_eval(problems, eval_every, start=known.get(key))
    trainer.add_callback(evaluator)
    start = time.perf_counter()
    trainer.train()
    history = trainer.state.log_history
    known[key] = evaluator.history[0][1]

    def curve(key):
        return [e[key] for e in history if key in e]

    return {"seconds": time.perf_counter() - start, "reward": curve("reward"), "kl": curve("mismatch/k3"),
            "grad_norm": curve("grad_norm"), "ess": curve("is/ess"), "token_chi2": curve("is/token_chi2"),
            "seq_chi2": curve("is/seq_chi2"), "token_weight_mean": curve("is/token_weight_mean"),
            "seq_weight_mean": curve("is/seq_weight_mean"), "corrected": curve("is/corrected_fraction"),
            "length": curve("completions/mean_length"), "eval_problems": len(problems),
            "eval_steps": [s for s, _ in evaluator.history], "eval": [a for _, a in evaluator.history]}


def dial_kl(model, settings: list[str], prompts: list[list[int]], length: int, seed: int = 0,
            device: str = "cpu", window: int = 100) -> dict:
    """Exact KL[μ‖π] of a sampler at each dial setting against the fp32 trainer, on sequences of `length`
    tokens sampled by that sampler: per token, per token within the first `window` tokens, and summed
    along each sequence (averaged over sequences)."""
    from . import mismatch

    scorer = rollout.TrainingEngine(model, torch.float32, device)
    found = {}
    for name in settings:
        engine = sampler_precision.engine(model, name, device)
        sampled = engine.sample(prompts, length, length, keep_vocab=True,
                                generator=torch.Generator(device).manual_seed(seed))
        scored = scorer.score(sampled, keep_vocab=True)
        per_token = mismatch.token_kl(sampled.vocab_logprobs, scored.vocab) * sampled.mask
        found[name] = {"token_kl": float(per_token.sum() / sampled.mask.sum()),
                       "token_kl_window": float(per_token[:, :window].sum() / sampled.mask[:, :window].sum()),
                       "seq_kl": float(per_token.sum(-1).mean()),
                       "seq_kl_stderr": float(per_token.sum(-1).std() / len(prompts) ** 0.5) if len(prompts) > 1 else float("nan"),
                       "tokens": int(sampled.mask.sum()),
                       "seconds": sampled.seconds}
    return found


def policy_gradient(model, engine, prompts: list[list[int]], answers: list[str], tokenizer, group: int,
                    batches: int, max_new_tokens: int, seed: int) -> torch.Tensor:
    """The GRPO policy gradient at fixed weights, one row per batch sampled by `engine` ([batches, parameters]).

    Each prompt gets `group` completions; advantages are rewards minus the group mean over the group's
    std (trl's default scaling); the loss is −Σ A·log π over tokens / tokens, on-policy (ratio 1), so
    each row estimates E[A ∇log π] on samples of whichever sampler `engine` is. Average the rows for
    the gradient; their spread gives its standard error.
    """
    generator = torch.Generator(engine.device).manual_seed(seed)
    engine.sync(model)
    params = [p for p in model.parameters() if p.requires_grad]
    repeated = [p for p in prompts for _ in range(group)]
    targets = [a for a in answers for _ in range(group)]
    rows = []
    for _ in range(batches):
        out = engine.sample(repeated, max_new_tokens, generator=generator)
        texts = tokenizer.batch_decode(out.completions(), skip_special_tokens=True)
        grouped = torch.tensor([task.exact_match(t, a) for t, a in zip(texts, targets)]).view(-1, group)
        advantage = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-4)).flatten()
        ids, _, offsets = rollout.pack(out, torch.arange(len(repeated)), engine.pad_id)
        device = next(model.parameters()).device
        logits = model(**rollout.packed_inputs(ids, device)).logits.float().cpu()
        steps = out.completion_ids.shape[1]
        logp = torch.stack([torch.log_softmax(logits[i, o - 1:o - 1 + steps], -1)
                            .gather(-1, out.completion_ids[i].clamp(min=0)[:, None]).squeeze(-1)
                            for i, o in enumerate(offsets)])
        loss = -(advantage[:, None] * logp * out.mask).sum() / out.mask.sum()
        rows.append(torch.cat([g.flatten().cpu() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def agreement(rows: torch.Tensor, reference: torch.Tensor) -> dict:
    """Cosine and relative difference of the mean of `rows` against `reference`, with the cosine's
    jackknife standard error over the rows (the reference held fixed)."""
    mean = rows.mean(0)
    count = rows.shape[0]
    leave_one_out = [cosine((mean * count - row) / (count - 1), reference) for row in rows]
    centre = sum(leave_one_out) / count
    stderr = ((count - 1) / count * sum((c - centre) ** 2 for c in leave_one_out)) ** 0.5
    return {"cosine": cosine(mean, reference), "cosine_stderr": stderr,
            "relative_difference": relative_difference(mean, reference)}


def paired_bias(rows: torch.Tensor, baseline: torch.Tensor) -> dict:
    """The squared bias of a sampler's policy gradient, relative to π's, from batches paired with π's.

    `rows` and `baseline` are per-batch gradients ([batches, parameters]) drawn with the same random
    numbers, from the sampler under test and from π. With d_b their difference, ‖d̄‖² overstates
    ‖E d‖² by the noise tr Cov(d)/B; subtracting it leaves an unbiased estimate of the squared bias.
    The same correction gives ‖E g_π‖², and the ratio is the squared bias relative to the gradient.
    Its standard error is a jackknife over the batch pairs. Where the noise-corrected ‖E g_π‖² is not
    positive, in all the batches or in any leave-one-out subset, the batches have not resolved π's own
    gradient and the ratio is not reported (NaN).
    """
    def squared_mean(x):  # unbiased estimate of ‖E x‖² from rows x_b
        count = x.shape[0]
        mean = x.mean(0)
        noise = (x - mean).square().sum() / (count - 1) / count
        return float(mean.square().sum() - noise)

    d, g = (rows - baseline).double(), baseline.double()
    count = d.shape[0]
    if count < 3:
        raise ValueError("a paired bias estimate needs at least 3 batches.")
    if not bool(g.any()):  # every group's rewards were equal: no gradient, nothing to compare against
        return {"relative_bias_sq": float("nan"), "relative_bias_sq_stderr": float("nan")}
    keep = [torch.arange(count) != i for i in range(count)]
    signal = [squared_mean(g)] + [squared_mean(g[k]) for k in keep]
    if min(signal) <= 0:
        return {"relative_bias_sq": float("nan"), "relative_bias_sq_stderr": float("nan")}
    ratio = squared_mean(d) / signal[0]
    leave_one_out = [squared_mean(d[k]) / g_k for k, g_k in zip(keep, signal[1:])]
    centre = sum(leave_one_out) / count
    stderr = ((count - 1) / count * sum((v - centre) ** 2 for v in leave_one_out)) ** 0.5
    return {"relative_bias_sq": ratio, "relative_bias_sq_stderr": stderr}


class _Serial:
    """The pool interface, in this process."""

    def map(self, fn, items):
        return list(map(fn, items))

    def shutdown(self):
        pass


def workers(count: int):
    """A pool of `count` processes of one torch thread each (or this process, for 1) for the runs below.

    Every job is seeded on its own, so results do not depend on how the jobs were shared out. Each
    process loads the model once and keeps it. On Linux without a CUDA device (which a forked process
    could not use) the workers fork from a server that imported trl and the model code once
    (`labutils.run_imports`); elsewhere each is spawned and imports them itself.
    """
    if count <= 1:
        return _Serial()
    import concurrent.futures
    import multiprocessing

    if sys.platform == "linux" and not torch.cuda.is_available():  # one process imports, the workers fork from it
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["labutils.run_imports"])
    else:
        context = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(count, mp_context=context, initializer=_start_worker)


def _start_worker() -> None:
    torch.set_num_threads(1)
    _quiet_worker()


def _model(profile: Profile, model_id: str | None, model_seed: int = 0):
    """The dense model (and tokenizer), loaded once per process."""
    key = (model_id, profile.name, model_seed)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = models.load(model_id, kind="dense", profile=profile, seed=model_seed, device=profile.device)
    return _LOADED[key]


_LOADED: dict = {}


def _pooled(pool, count: int):
    """`pool` if given, else a fresh one of `count` workers that the caller must shut down (owned=True)."""
    return (pool, False) if pool is not None else (workers(count), True)


def comparison(profile: Profile, plan: GrpoPlan, specs: list[RunSpec], seeds: list[int], eval_count: int,
               eval_every: int, model_id: str | None = None, workers: int = 1,
               progress=print, pool=None, model_seed: int = 0) -> dict:
    """Run every spec at every seed; returns {run: [curves, one per seed]}.

    The runs go to `pool` (see `workers`), or to a pool of `workers` processes made for them.
    """
    jobs = [(spec, seed) for spec in specs for seed in seeds]
    context = (profile, plan, eval_count, eval_every, model_id, model_seed)
    if model_id is None:
        models.lab_model_dir("dense", profile, model_seed)  # built once here, not by every worker at once
    pool, owned = _pooled(pool, workers)
    try:
        done = list(pool.map(_job, [(context, job) for job in jobs]))
    finally:
        if owned:
            pool.shutdown()
    curves: dict[str, list[dict]] = {}
    for (spec, seed), result in zip(jobs, done):
        curves.setdefault(spec.name, []).append(result)
        progress(f"{spec.name} seed {seed}: π-eval {result['eval'][0]:.3f} → {result['eval'][-1]:.3f} "
                 f"({result['seconds']:.0f} s)")
    return curves


def dial_sweep(profile: Profile, settings: list[str], prompts: list[list[int]], length: int, seed: int,
               window: int, pool, model_id: str | None = None) -> dict:
    """`dial_kl` for every setting, one setting per job of `pool` (the lab model of build seed `seed`)."""
    context = (profile, model_id, prompts, length, seed, window)
    return dict(zip(settings, pool.map(_dial_job, [(context, name) for name in settings])))


def _dial_job(argument) -> dict:
    (profile, model_id, prompts, length, seed, window), name = argument
    model, _ = _model(profile, model_id, seed)
    return dial_kl(model, [name], prompts, length, seed, profile.device, window)[name]


def gradients(profile: Profile, jobs: list[tuple[str, int]], prompts: list[list[int]], answers: list[str],
              group: int, batches: int, max_new_tokens: int, pool, model_id: str | None = None,
              model_seed: int = 0) -> list:
    """`policy_gradient` rows for every (sampler setting, sampling seed) in `jobs`, one per job of `pool`."""
    context = (profile, model_id, model_seed, prompts, answers, group, batches, max_new_tokens)
    return pool.map(_gradient_job, [(context, job) for job in jobs])


def _gradient_job(argument) -> torch.Tensor:
    (profile, model_id, model_seed, prompts, answers, group, batches, max_new_tokens), (setting, seed) = argument
    model, tokenizer = _model(profile, model_id, model_seed)
    engine = sampler_precision.engine(model, setting, profile.device)
    return policy_gradient(model, engine, prompts, answers, tokenizer, group, batches, max_new_tokens, seed)


def _job(argument) -> dict:
    """One (spec, seed) run; the model is loaded once per process."""
    (profile, plan, eval_count, eval_every, model_id, model_seed), (spec, seed) = argument
    _quiet_worker()
    base, tokenizer = _model(profile, model_id, model_seed)
    output = tempfile.mkdtemp(prefix="mismatch-rl-")
    result = train(spec, base, tokenizer, profile, plan, seed, eval_problems(eval_count, plan), eval_every, output)
    if os.environ.get("LAB_PROGRESS"):  # the long run reports each finished run as it goes
        print(f"{spec.name} seed {seed}: π-eval {result['eval'][0]:.3f} → {result['eval'][-1]:.3f} "
              f"({result['seconds']:.0f} s)", flush=True)
    return result


def _quiet_worker() -> None:
    """A worker's stderr lands in the chapter: keep out the library notices that teach nothing here
    (transformers' renamed-argument FutureWarnings, bitsandbytes' optional CPU kernel, trl's experimental flag)."""
    import logging
    import warnings

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)


