"""The cross-engine run: llama.cpp's samples rescored by the torch trainer, beside torch's own, on the real model.

Every sampler (llama.cpp in each GGUF type, with flash attention at its default or off; the book's torch
engines in fp32, bf16, fp16 and FP8) draws
`sequences` completions of `tokens` tokens (EOS banned) from the same chat prompts with the same seed, keeping
log μ of the whole vocabulary; every trainer (torch, weights cast whole to fp32, bf16 or fp16, as FSDP's
`param_dtype`) rescores them. Per pair and sequence the run keeps, for each block of `block` positions, the
sum of the exact token KL[μ‖π] and of log π/μ at the sampled tokens: enough for the token KL and its
per-sequence (cluster) errors, the KL by position, the log-weight drift and its spread. Each sampler's speed
is timed on the same prompts without keeping the vocabulary, in tokens per second, after a short warm-up.

`make engines` runs it (about 30 minutes on 2 cores) and writes results/long/04c_cross_engine.json;
`engine_table` reads it.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from . import committed, llamacpp, mismatch, models, pretrained, rollout, sampler_precision

RUN = committed.Run("04c_cross_engine", module="cross_engine", make="make engines")
LLAMA = (("f32", "off"), ("f32", "auto"), ("f16", "off"), ("f16", "auto"), ("bf16", "off"), ("bf16", "auto"),
         ("q8_0", "auto"), ("q4_0", "auto"))  # (GGUF type, flash attention)
PLAN = {"tokens": 1024, "sequences": 8, "block": 64, "seed": 0, "temperature": 1.0, "speed_tokens": 256,
        "llama_cpp": llamacpp.VERSION, "llama_samplers": LLAMA, "torch_samplers": ("fp32", "bf16", "fp16", "fp8"),
        "trainers": ("fp32", "bf16", "fp16")}
SMOKE = {**PLAN, "tokens": 128, "sequences": 2, "speed_tokens": 32, "llama_samplers": (("f32", "off"), ("bf16", "auto")),
         "torch_samplers": ("fp32",), "trainers": ("fp32", "bf16")}


def llama_name(kind: str, flash_attention: str) -> str:
    """A llama.cpp sampler's name: llama.cpp:bf16 at llama.cpp's defaults, llama.cpp:bf16:fa_off without flash
    attention."""
    return f"llama.cpp:{kind}" + ("" if flash_attention == "auto" else ":fa_off")


def load(plan: dict = PLAN) -> tuple[dict | None, str | None]:
    """The committed run and, where it cannot be shown beside this checkout, why."""
    return RUN.load(plan, pretrained.identity())


def samplers(model, plan: dict) -> dict:
    """Name → a function that builds the sampler (one engine in memory at a time)."""
    out = {llama_name(kind, fa): (lambda kind=kind, fa=fa: llamacpp.Engine(kind, flash_attention=fa))
           for kind, fa in plan["llama_samplers"]}
    out.update({f"torch:{name}": (lambda name=name: sampler_precision.engine(model, name))
                for name in plan["torch_samplers"]})
    return out


def blocks(values: torch.Tensor, block: int) -> list[list[float]]:
    """Per row, the sums of `values` over consecutive runs of `block` positions."""
    rows, length = values.shape
    return values.double()[:, : length // block * block].reshape(rows, -1, block).sum(-1).tolist()


def measure(model, prompts: list[list[int]], plan: dict) -> dict:
    """Every sampler against every trainer: block sums of the token KL and the log-ratio, and each sampler's speed."""
    trainers = {name: rollout.TrainingEngine(model, rollout.DTYPES[name], "cpu", micro_batch=4)
                for name in plan["trainers"]}
    found = {"samplers": {}, "pairs": {}}
    for name, build in samplers(model, plan).items():
        engine = build()
        engine.sample(prompts, 4, 4, generator=torch.Generator().manual_seed(plan["seed"] + 2))  # warm-up
        timed = engine.sample(prompts, plan["speed_tokens"], plan["speed_tokens"], temperature=plan["temperature"],
                              generator=torch.Generator().manual_seed(plan["seed"] + 1))
        out = engine.sample(prompts, plan["tokens"], plan["tokens"], temperature=plan["temperature"],
                            generator=torch.Generator().manual_seed(plan["seed"]), keep_vocab=True)
        if hasattr(engine, "close"):
            engine.close()
        del engine
        speed = timed.mask.sum().item() / timed.seconds
        found["samplers"][name] = {"tokens_per_second": speed, "speed_seconds": timed.seconds,
                                   "sample_seconds": out.seconds, "first_tokens": out.completion_ids[:, :16].tolist()}
        print(f"{name}: {speed:.0f} tokens/s; {len(prompts)} × {plan['tokens']} tokens in {out.seconds:.0f} s",
              flush=True)
        for trainer_name, trainer in trainers.items():
            began = time.perf_counter()
            scored = trainer.score(out, plan["temperature"], keep_vocab=True)
            mask = out.mask.double()
            kl = mismatch.token_kl(out.vocab_logprobs, scored.vocab) * mask
            log_ratio = (scored.logprobs - out.logprobs).double() * mask
            found["pairs"][f"{name}|torch:{trainer_name}"] = {
                "kl_blocks": blocks(kl, plan["block"]), "log_ratio_blocks": blocks(log_ratio, plan["block"]),
                "score_seconds": time.perf_counter() - began}
            print(f"  against torch:{trainer_name}: token KL {float(kl.sum() / mask.sum()):.3g}", flush=True)
            del scored, kl
        del out
    return found


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a two-minute version, written to --target")
    parser.add_argument("--target", type=Path, default=None)
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else PLAN
    began, code = time.time(), RUN.fingerprint(plan)
    model, tokenizer = models.load(pretrained.NAME, "dense", None)
    prompts = pretrained.chat_prompts(tokenizer, plan["sequences"])
    found = measure(model, prompts, plan)
    found["precision"] = dict(llamacpp.PRECISION)
    found["precision_sources"] = dict(llamacpp.SOURCES)
    target = RUN.write(found, plan, pretrained.identity(), began, args.target, code)
    print(f"wrote {target} in {(time.time() - began) / 60:.1f} minutes")
    return target


if __name__ == "__main__":
    main()
