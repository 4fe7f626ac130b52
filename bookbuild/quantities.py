"""Quantities the book measures both on its toy model and on the real one, so that a verdict reads the real one.

A chapter that measures a quantity on SmolLM2-135M records it under a `real.` key: the same key with `real.`
in front where the toy's key has the same name, or a key of another chapter (chapter 4b measures on the real
model what chapter 4 measures on the toy). A ledger verdict or a findings row that reads the toy's number where
the real model's is recorded, without reading the real one beside it, judges the toy in the real model's place.
"""
from __future__ import annotations

# toy metric -> the real model's metric for the same quantity, where their names differ
REAL_OF = {
    "04_mismatch:grid.bf16_bf16.token_kl": "04b_real_mismatch:real.token_kl.bf16",
    "04_mismatch:grid.fp16_fp16.token_kl": "04b_real_mismatch:real.token_kl.fp16",
    "04_mismatch:grid.bf16_fp32.token_kl": "04b_real_mismatch:real.token_kl.bf16_train_fp32_infer",
    "05_grpo_precision:combo.bf16_bf16.mean_kl": "05_grpo_precision:real.rl.long.bf16_bf16.probe_kl_start",
    "05_grpo_precision:combo.fp16_fp16.mean_kl": "05_grpo_precision:real.rl.long.fp16_fp16.probe_kl_start",
    "05_grpo_precision:ratio.kl_bf16_over_fp16": "05_grpo_precision:real.rl.long.ratio_start",
    "07_lora:serving.token_kl.bf16.unmerged_bf16": "07_lora:real.serving.token_kl.unmerged_bf16",
}


def recorded(ref: str, runs: dict) -> bool:
    """Whether `chapter:key` is in this build's results."""
    chapter, _, key = ref.partition(":")
    return key in runs.get(chapter, {}).get("metrics", {})


def real_counterpart(ref: str, runs: dict) -> str | None:
    """The real model's metric for the quantity of the toy metric `ref`, where this build records one."""
    chapter, _, key = ref.partition(":")
    if key.startswith("real."):
        return None
    candidate = REAL_OF.get(ref, f"{chapter}:real.{key}")
    return candidate if recorded(candidate, runs) else None


def toy_in_place_of_real(refs: set[str], runs: dict) -> list[str]:
    """The toy metrics among `refs` whose real-model counterpart is recorded but not read beside them."""
    return sorted(f"{ref} (the real model's: {real})" for ref in refs
                  if (real := real_counterpart(ref, runs)) is not None and real not in refs)
