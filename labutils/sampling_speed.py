"""Sampling against a plain forward over the same tokens, with the chapters' own engines.

Generated tokens only, EOS banned, one-token prompts so that both count the same tokens; the forward at
its best micro-batch. Chapter 4b measures at its profile's size in every build; the size that shows
a serving-like workload, 32 sequences × 512 tokens in bf16 and fp16, takes minutes in fp16 on a CPU
without fp16 matrix instructions, so it is a committed run:

    python -m labutils.sampling_speed      # writes results/long/04b_sampling_speed.json (make speed)

Its fingerprint (`labutils.committed`) covers the code that samples and scores (this module, rollout and
what they import) and the real model's file; chapter 4b refuses a file whose fingerprint does not match.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from . import committed, rollout

RUN = committed.Run("04b_sampling_speed", module="sampling_speed", make="make speed")
BATCH, LENGTH, PRECISIONS = 32, 512, ("bf16", "fp16")
PLAN = {"batch": BATCH, "length": LENGTH, "precisions": PRECISIONS}


def measure(model, precision: str, batch: int, length: int, micro_batches: tuple[int, ...] = (32, 8),
            device: str = "cpu", seed: int = 0) -> dict:
    """Tokens per second of sampling `batch` × `length` tokens and of the plain forward over them."""
    sampler = rollout.InferenceEngine(model, rollout.engine_dtype(precision, device), device)
    bos = rollout.special_ids(model.config)[0]  # any one token: the prompt only starts the rows
    out = sampler.sample([[bos]] * batch, length, length, generator=torch.Generator(device).manual_seed(seed))
    tokens = int(out.mask.sum())
    forward = {mb: rollout.plain_forward_seconds(sampler.model, out, mb, device) for mb in micro_batches}
    best = min(forward, key=forward.get)
    return {"batch": batch, "length": length, "tokens": tokens, "sample_tokens_per_s": tokens / out.seconds,
            "forward_tokens_per_s": tokens / forward[best], "best_micro_batch": best,
            "sample_over_forward": forward[best] / out.seconds}


def load() -> tuple[dict | None, str | None]:
    """The committed run and, where it cannot be used, why."""
    from . import pretrained

    return RUN.load(PLAN, pretrained.identity())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=None)
    args = parser.parse_args(argv)
    from . import models, pretrained

    model, _ = models.load(pretrained.NAME)
    began, code = time.time(), RUN.fingerprint(PLAN)
    speeds = {}
    for precision in PRECISIONS:
        speeds[precision] = measure(model, precision, BATCH, LENGTH)
        print(f"{precision}: sampling {speeds[precision]['sample_tokens_per_s']:.0f} tokens/s, forward "
              f"{speeds[precision]['forward_tokens_per_s']:.0f}: {speeds[precision]['sample_over_forward']:.0%}")
    print(f"wrote {RUN.write({'speeds': speeds}, PLAN, pretrained.identity(), began, args.target, code)}")


if __name__ == "__main__":
    main()
