"""The long run behind chapter 5b's verdict, in three phases fixed before any run (`make long`):

1. the regime, chosen on the fp32 control alone: a learning-rate sweep, then the largest stable rate
   kept only if as many fresh control seeds pass the same test there (the largest rate that passes a
   few seeds may be the edge of stability), else the next stable one down;
2. the dose–response at that regime: every dial setting, its score against its own token KL;
3. the pre-registered fix comparison at the coarsest setting, with as many fresh seeds as the
   power asks for and the budget allows.

    python -m labutils.long_run            # writes results/long/05b_sampler_precision.json
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path

import torch

from . import committed, mismatch_rl, models, rl_design
from .profiles import PROFILES, Profile

CHAPTER = mismatch_rl.CHAPTER
RUN = committed.Run(CHAPTER, module="long_run", make="make long")
# the dial, finest emulated setting first; not m = 10, whose samples are the fp32 control's token for token here
DOSE = ("m7", "m5", "m4", "m3", "m2", "fp8", "bf16")
VALIDATION_SEED0 = 50  # the regime's check on fresh control seeds: none of them trained in the sweep
FIX_SEED0 = 100  # the fix comparison's seeds are fresh: none of them trained in phases 1 or 2


def plan_read(profile: Profile) -> dict:
    """The parts of a profile the run reads: the lab model, task and GRPO config, its own plan, the sampler's
    bits and the RL plan at its steps. Their values enter the fingerprint, so the chapter's own sizes (its
    offline dial, its short runs) can change without making the long run stale."""
    L = profile.sampler.long
    return {"name": profile.name, "device": profile.device, "dense": profile.dense, "warmup": profile.warmup,
            "task": profile.task, "grpo": profile.grpo, "bits": profile.sampler.bits, "long": L,
            "plan": dataclasses.replace(profile.sampler_rl, steps=L.steps)}


def model_fingerprint(profile: Profile, seed: int = 0) -> str:
    """The lab model's build key: its size, warm-up and the code that builds it."""
    return models.build_key("dense", profile.dense, profile.warmup, seed)


def load(profile: Profile | None = None) -> tuple[dict | None, str | None]:
    """The committed long run and, where this checkout cannot judge it, why (one sentence)."""
    profile = profile or PROFILES["cpu"]
    return RUN.load(plan_read(profile), model_fingerprint(profile))


def _jobs(pool, profile: Profile, jobs: list[tuple], eval_count: int, eval_every: int) -> list[dict]:
    """Run (spec, seed, plan) jobs on `pool`, longest-expected first; results in the order given."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0].sampler == "fp32")  # dial runs are slower
    argument = [((profile, jobs[i][2], eval_count, eval_every, None, 0), (jobs[i][0], jobs[i][1])) for i in order]
    done = dict(zip(order, pool.map(mismatch_rl._job, argument)))
    return [done[i] for i in range(len(jobs))]


def _within_arm_sd(scores: dict[str, list[float]]) -> tuple[float, int]:
    """The pooled per-seed standard deviation of scores around their own arm's mean, and its degrees of freedom."""
    squares = sum(sum((s - sum(v) / len(v)) ** 2 for s in v) for v in scores.values() if len(v) > 1)
    dof = sum(len(v) - 1 for v in scores.values() if len(v) > 1)
    return math.sqrt(squares / dof), dof


def run(target: Path | None = None, workers: int = 2, profile: Profile | None = None, dose: tuple[str, ...] = DOSE) -> Path:
    """All three phases, written to `target` with their curves, the design and the provenance."""
    profile = profile or PROFILES["cpu"]
    read = plan_read(profile)
    L, base, bits = read["long"], read["plan"], read["bits"]
    specs = mismatch_rl.runs_at(bits)
    specs.update({name: mismatch_rl.RunSpec(name, name) for name in dose if name not in specs})
    began, code = time.time(), RUN.fingerprint(read)  # the code as it starts, not as it ends
    models.lab_model_dir("dense", profile)  # built once here, not by every worker at once
    os.environ["LAB_PROGRESS"] = "1"
    pool = mismatch_rl.workers(workers)
    start, phases = time.perf_counter(), {}
    curves: dict[str, dict] = {"sweep": {}, "dose": {}, "fix": {}}
    try:
        # 1. the regime, on the control alone
        sweep_seeds = list(range(L.sweep_seeds))
        jobs = [(specs["fp32"], seed, dataclasses.replace(base, lr=lr)) for lr in L.lrs for seed in sweep_seeds]
        done = _jobs(pool, profile, jobs, L.eval_problems, L.eval_every)
        for (_, _, plan), result in zip(jobs, done):
            curves["sweep"].setdefault(f"{plan.lr:g}", []).append(result)
        sweep = {float(lr): rl_design.regime(c, L.eval_problems, L.min_gain) for lr, c in curves["sweep"].items()}
        chosen, validation = None, {}
        for lr in rl_design.stable_rates(sweep):  # largest first, until fresh control seeds pass there too
            fresh = list(range(VALIDATION_SEED0, VALIDATION_SEED0 + L.sweep_seeds))
            done = _jobs(pool, profile, [(specs["fp32"], seed, dataclasses.replace(base, lr=lr)) for seed in fresh],
                         L.eval_problems, L.eval_every)
            curves.setdefault("validation", {})[f"{lr:g}"] = done
            validation[f"{lr:g}"] = rl_design.regime(done, L.eval_problems, L.min_gain)
            print(f"validation at lr {lr:g}: {validation[f'{lr:g}']['stable']}", flush=True)
            if validation[f"{lr:g}"]["stable"]:
                chosen = lr
                break
        phases["sweep"] = time.perf_counter() - start
        print(f"sweep: {({lr: s['stable'] for lr, s in sweep.items()})}; chosen lr {chosen}", flush=True)
        if chosen is None:
            raise SystemExit("No stable learning rate of the sweep passed again on fresh fp32 seeds "
                             f"({sweep}, {validation}): add smaller rates to `lrs` in the cpu profile's long plan.")
        plan = dataclasses.replace(base, lr=chosen)
        # 2. the dose–response at the chosen regime; its fp32 arm is the sweep's seeds at that rate
        jobs = [(specs[name], seed, plan) for name in dose for seed in sweep_seeds]
        for (spec, _, _), result in zip(jobs, _jobs(pool, profile, jobs, L.eval_problems, L.eval_every)):
            curves["dose"].setdefault(spec.name, []).append(result)
        curves["dose"]["fp32"] = curves["sweep"][f"{chosen:g}"]
        phases["dose"] = time.perf_counter() - start - phases["sweep"]
        # 3. power from the regime's own seeds, then the fix comparison on fresh seeds. The spread comes from the
        # dial's arms, not the control's: its seeds were selected by passing the sweep. The plan takes the
        # spread's 80% upper bound, since planning on the estimate itself misses the power half the time.
        scores = {name: [rl_design.score(c["eval"]) for c in per_seed]
                  for name, per_seed in curves["dose"].items() if name != "fp32"}
        sd_seed, dof = _within_arm_sd(scores)
        sd_diff = math.sqrt(2) * rl_design.planning_sd(sd_seed, dof)  # paired seeds of different samplers hardly correlate
        needed = rl_design.seeds_needed(L.smallest_effect, sd_diff)
        roles = mismatch_rl.roles(bits)
        per_seed_cost = sum(sum(c["seconds"] for c in curves["dose"][specs[r].sampler]) / L.sweep_seeds
                            for r in roles.values())  # the TIS run costs what its sampler's run costs
        left = L.budget_minutes * 60 - (time.perf_counter() - start)
        fits = max(2, int(left * workers / per_seed_cost))
        fix_seeds = list(range(FIX_SEED0, FIX_SEED0 + min(needed, fits, L.max_fix_seeds)))
        print(f"power: sd {sd_seed:.3f} ({dof} dof), {needed} seeds needed, {len(fix_seeds)} run", flush=True)
        jobs = [(specs[name], seed, plan) for name in roles.values() for seed in fix_seeds]
        for (spec, _, _), result in zip(jobs, _jobs(pool, profile, jobs, L.eval_problems, L.eval_every)):
            curves["fix"].setdefault(spec.name, []).append(result)
        phases["fix"] = time.perf_counter() - start - phases["sweep"] - phases["dose"]
    finally:
        pool.shutdown()
    payload = {
        "chapter": CHAPTER, "kind": "long run", "profile": profile.name,
        "seconds": round(time.perf_counter() - start, 1), "phase_seconds": {k: round(v, 1) for k, v in phases.items()},
        "workers": workers,
        "design": {"long": dataclasses.asdict(L), "plan": dataclasses.asdict(plan), "bits": bits, "roles": roles,
                   "dose": list(dose), "sweep": {f"{lr:g}": s for lr, s in sweep.items()}, "validation": validation,
                   "chosen_lr": chosen, "sd_seed": sd_seed, "sd_dof": dof, "sd_diff": sd_diff, "seeds_needed": needed,
                   "fix_seeds": fix_seeds},
        "curves": curves,
    }
    return RUN.write(payload, read, model_fingerprint(profile), began, target, code)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes, one torch thread each")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"wrote {run(workers=args.workers)}")


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main()
