"""The atlas: what moves the mismatch, one factor at a time from a bf16/bf16 baseline, each row a doctor run.

The baseline is the book's torch sampler in bf16 against a torch trainer whose weights are cast whole to
bf16 (FSDP's `param_dtype`), its eight sequences scored in one batch, at temperature 1, no top-p, the LM
head in bf16, no adapter. Each other row changes one thing: the dtype (fp32 and fp16 on both sides; FP8,
Q8_0 and Q4_0 rollouts against the bf16 trainer), the engine (llama.cpp's BF16, with its flash attention
and without), an fp32 head on the
sampler's side or on both, top-p 0.9, temperature 0.7 with log μ after the temperature or raw (vLLM V1's
default), each sequence scored alone, a LoRA adapter merged in the sampler and unmerged in the trainer,
and the trainer under autocast instead of pure. Every row samples from the same prompts with the same
seed, so each row's token KL is compared with the baseline's prompt by prompt.

`make atlas` runs it (about 15 minutes on 2 cores) and writes results/long/04c_atlas.json.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from . import committed, doctor, llamacpp, pretrained

RUN = committed.Run("04c_atlas", module="atlas", make="make atlas")
BASE = {"--sampler": "torch:bf16", "--trainer": "torch:bf16", "--trainer-mode": "pure", "--micro-batch": "8"}
# (factor, setting, the flags that differ from BASE)
ROWS = (
    ("baseline", "bf16 sampler, bf16 trainer (pure), batch of 8", {}),
    ("dtype", "fp32 on both sides", {"--sampler": "torch:fp32", "--trainer": "torch:fp32"}),
    ("dtype", "fp16 on both sides", {"--sampler": "torch:fp16", "--trainer": "torch:fp16"}),
    ("dtype", "FP8 W8A8 sampler", {"--sampler": "torch:fp8"}),
    ("dtype", "Q8_0 sampler (llama.cpp)", {"--sampler": "llama.cpp:q8_0"}),
    ("dtype", "Q4_0 sampler (llama.cpp)", {"--sampler": "llama.cpp:q4_0"}),
    ("engine", "llama.cpp BF16 sampler", {"--sampler": "llama.cpp:bf16"}),
    ("engine", "llama.cpp BF16 sampler, flash attention off", {"--sampler": "llama.cpp:bf16",
                                                               "--flash-attention": "off"}),
    ("fp32 LM head", "on the sampler's side", {"--fp32-head": "sampler"}),
    ("fp32 LM head", "on both sides", {"--fp32-head": "both"}),
    ("top-p", "0.9 (the trainer scores the full distribution)", {"--top-p": "0.9"}),
    ("temperature", "0.7, log μ after the temperature", {"--temperature": "0.7"}),
    ("temperature", "0.7, raw log μ (vLLM V1's default)", {"--temperature": "0.7", "--logprobs": "raw"}),
    ("batch", "each sequence scored alone", {"--micro-batch": "1"}),
    ("LoRA", "rank 16, 1% of each weight, merged in the sampler", {"--lora": "0.01"}),
    ("trainer", "autocast over fp32 weights", {"--trainer-mode": "autocast"}),
)
PLAN = {"tokens": 512, "sequences": 8, "seed": 0, "rows": ROWS, "base": BASE, "llama_cpp": llamacpp.VERSION}


def load() -> tuple[dict | None, str | None]:
    """The committed atlas and, where it cannot be shown beside this checkout, why."""
    return RUN.load(PLAN, pretrained.identity())


def row_args(flags: dict, plan: dict, folder: Path) -> argparse.Namespace:
    """The doctor's arguments for one row."""
    merged = {**plan["base"], **flags, "--tokens": str(plan["tokens"]), "--sequences": str(plan["sequences"]),
              "--seed": str(plan["seed"]), "--device": "cpu", "--json": str(folder / "row.json")}
    return doctor._parser().parse_args([part for pair in merged.items() for part in pair])


KEPT = ("token_kl", "k3", "drift_per_1k", "prefix_sd", "sequence_weights", "per_sequence_kl", "top_p", "seconds")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=None)
    args = parser.parse_args(argv)
    began, code = time.time(), RUN.fingerprint(PLAN)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for factor, setting, flags in PLAN["rows"]:
            found = doctor.run(row_args(flags, PLAN, Path(folder)))
            trl = found["trl_modes"]
            last = trl["lengths"][-1]
            rows.append(doctor._plain({"factor": factor, "setting": setting, "flags": flags,
                                       **{k: found[k] for k in KEPT if k in found},
                                       "trl_default_cut": trl[trl["defaults"]["mode"]][last]["cut_share"],
                                       "sampler_label": found["setup"]["sampler_label"]}))
            print(f"{factor}: {setting}: token KL {found['token_kl']['value']:.3g} ± "
                  f"{found['token_kl']['stderr']:.2g}", flush=True)
    target = RUN.write({"rows": rows}, PLAN, pretrained.identity(), began, args.target, code)
    print(f"wrote {target} in {(time.time() - began) / 60:.1f} minutes")
    return target


if __name__ == "__main__":
    main()
