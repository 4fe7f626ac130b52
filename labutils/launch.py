"""One GRPO run as a script, for `accelerate launch`: the same experiment on 1 or N processes.

    accelerate launch --multi_gpu --num_processes 2 -m labutils.launch --profile cpu --out DIR

(`--multi_gpu` picks the torchrun launcher; without CUDA the processes use the CPU and gloo.)

The global batch (completions per optimizer step) is the profile's whatever the number of
processes: each process generates and trains on its share, and DDP averages the gradients.
Rank 0 writes `<out>/result.json`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch
    from transformers.utils import logging as hf_logging

    from . import grpo, models, profiles

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    P = profiles.check_parameters(args.profile, args.seed, steps=args.steps)
    plan = P.rl
    if plan.batch_size % world:
        raise ValueError(f"the global batch of {plan.batch_size} does not split over {world} processes.")
    plan = dataclasses.replace(plan, steps=args.steps or plan.steps)
    torch.manual_seed(args.seed)
    model, tokenizer = models.load(None, "dense", P, args.seed)
    config = grpo.config(P, args.out, seed=args.seed, plan=plan, per_device_train_batch_size=plan.batch_size // world)
    trainer = grpo.trainer(model, tokenizer, config, P, seed=args.seed, plan=plan)
    measured = grpo.train_measured(trainer, P.device,
                                   last=max(1, plan.steps // 4))
    if trainer.accelerator.is_main_process:
        result = {"world_size": trainer.accelerator.num_processes, "global_batch": plan.batch_size,
                  "per_process_batch": config.per_device_train_batch_size,
                  "backend": str(trainer.accelerator.state.backend),
                  **{k: measured[k] for k in ("final_reward", "reward_curve", "grad_norm_curve", "seconds",
                                              "tokens_per_s")}}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()


def forked_runs(target: str, jobs: list[dict], preload: tuple[str, ...] = (), timeout: float | None = None) -> list[dict]:
    """`module:function(**job)` for each job, each in a process of its own; their JSON-able results, in order.

    One fresh Python process imports `preload` and the target's module, runs nothing else, and forks
    one child per job, one after the other. Each child starts as a fresh process would after those
    imports (the interpreter and the libraries, nothing any other job allocated), and its peak resident
    set (VmHWM, which Linux resets at fork) is its own; the imports are paid once instead of per job.
    """
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as folder:
        spec = Path(folder) / "jobs.json"
        spec.write_text(json.dumps({"target": target, "jobs": jobs, "preload": list(preload)}))
        done = subprocess.run([sys.executable, "-c", "import sys; from labutils.launch import _fork_each; "
                               "_fork_each(sys.argv[1])", folder], cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{target} failed in a forked process (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return [json.loads((Path(folder) / f"{i}.json").read_text()) for i in range(len(jobs))]


def _fork_each(folder: str) -> None:
    """The parent process of `forked_runs`: import, then fork and wait for one child per job."""
    import importlib
    import sys
    import traceback

    spec = json.loads((Path(folder) / "jobs.json").read_text())
    for name in spec["preload"]:
        importlib.import_module(name)
    module, name = spec["target"].split(":")
    function = getattr(importlib.import_module(module), name)
    for i, job in enumerate(spec["jobs"]):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                (Path(folder) / f"{i}.json").write_text(json.dumps(function(**job)))
            except BaseException:  # the child must never return into the parent's loop
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"job {i} of {spec['target']} failed (exit status {os.waitstatus_to_exitcode(status)}).")
