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


def refusal(profile, processes: int) -> str | None:
    """Why `processes` processes of this script cannot run here, in one sentence; None where they can.

    On CUDA every process needs a GPU of its own: accelerate places rank r on GPU r modulo the GPU count,
    and NCCL refuses two ranks on one device ("Duplicate GPU detected"). On the CPU any number share the
    cores through gloo.
    """
    if profile.device != "cuda" or processes <= 1:
        return None
    import torch

    gpus = torch.cuda.device_count()
    if gpus >= processes:
        return None
    return (f"a DDP run on {processes} processes needs {processes} GPUs and this machine has {gpus}: "
            "NCCL refuses two processes on one GPU; run this chapter on a machine with "
            f"{processes} GPUs, or with profile='cpu', where the processes share the cores.")


def require(profile, processes: int) -> None:
    """Raise `refusal`'s sentence before any launch spends its steps (a chapter's set-up cell calls it)."""
    reason = refusal(profile, processes)
    if reason:
        raise RuntimeError(reason)


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
