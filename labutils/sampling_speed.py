"""Sampling against a plain forward over the same tokens, with the chapters' own engines.

Generated tokens only, EOS banned, one-token prompts so that both count the same tokens; the forward at
its best micro-batch. Chapter 4b measures at its profile's size in every build; the size that shows
a serving-like workload, 32 sequences × 512 tokens in bf16 and fp16, takes minutes in fp16 on a CPU
without fp16 matrix instructions, so it is a committed run:

    python -m labutils.sampling_speed      # writes results/long/04b_sampling_speed.json (make speed)

Its fingerprint covers the code that samples and scores (rollout and what it imports, and this module)
and the real model's file; chapter 4b refuses a file whose fingerprint does not match.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

from . import env, rollout

TARGET = Path(__file__).resolve().parent.parent / "results" / "long" / "04b_sampling_speed.json"
BATCH, LENGTH, PRECISIONS = 32, 512, ("bf16", "fp16")


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


def code_fingerprint() -> str:
    """A hash of this module and of the modules the engines run (rollout and its labutils imports)."""
    from .long_run import modules_run

    folder = Path(__file__).parent
    digest = hashlib.sha256()
    for module in ["sampling_speed", *modules_run("rollout")]:
        digest.update(module.encode() + b"\0" + (folder / f"{module}.py").read_bytes())
    return digest.hexdigest()[:16]


def model_fingerprint() -> str:
    """The converted real model's folder name, which carries the GGUF file's fingerprint."""
    from . import models, pretrained

    return Path(models.resolve_model(pretrained.NAME, "dense", None)).name


def stale(payload: dict) -> str | None:
    """Why the committed speed run cannot be shown beside this build (one sentence), or None."""
    made = payload.get("provenance", {})
    if made.get("code") != code_fingerprint() or made.get("model") != model_fingerprint():
        return ("The committed 32 × 512 speed run was made by other sampling code or another model than this "
                "checkout's: run `make speed` and commit its file.")
    return None


def load() -> tuple[dict | None, str | None]:
    """The committed run and, where it cannot be used, why."""
    if not TARGET.is_file():
        return None, "No committed 32 × 512 speed run: run `make speed` and commit its file."
    payload = json.loads(TARGET.read_text())
    return payload, stale(payload)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=TARGET)
    args = parser.parse_args(argv)
    from . import models, pretrained

    model, _ = models.load(pretrained.NAME)
    began = time.time()
    speeds = {}
    for precision in PRECISIONS:
        speeds[precision] = measure(model, precision, BATCH, LENGTH)
        print(f"{precision}: sampling {speeds[precision]['sample_tokens_per_s']:.0f} tokens/s, forward "
              f"{speeds[precision]['forward_tokens_per_s']:.0f}: {speeds[precision]['sample_over_forward']:.0%}")
    payload = {"speeds": speeds, "minutes": (time.time() - began) / 60,
               "provenance": {"code": code_fingerprint(), "model": model_fingerprint(),
                              "date": time.strftime("%Y-%m-%d", time.gmtime(began)), "cpu": env.cpu_model(),
                              "kernel_set": env.kernel_set(), "torch_threads": torch.get_num_threads(),
                              "env": env.env_report()}}
    args.target.parent.mkdir(parents=True, exist_ok=True)
    args.target.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.target}")


if __name__ == "__main__":
    main()
