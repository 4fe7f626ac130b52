"""The chapters whose numbers move with the CPU's kernels, run under another kernel set.

    python -m bookbuild.kernels_check   (make kernels-check; CI runs it after make test)

The same seed draws other floats under other kernels, and so other samples: a test or
a ledger verdict that passes under one kernel set only is tuned to one machine's draw.
This executes chapters 4, 4b (the real model, whose kernels alone move π by a share of
the mismatch it measures), 5, 5b and 6 with oneDNN capped one level below what it picks
here (or, on a CPU without AVX-512, ATen's vector code off), runs their chapter-metric
tests on those results, and checks that every ledger verdict they decide is the same as
under the default kernels.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

STEMS = ("04_mismatch", "04b_real_mismatch", "05_grpo_precision",
         "05b_sampler_precision", "06_moe")
# the chapters' metric tests in tests/test_chapters.py that read only STEMS; they
# compare with recorded standard errors or invariants, so they hold under any kernels
TEST_NAMES = ("test_mismatch_orders_the_precisions",
              "test_real_model_mismatch_follows_the_mantissa",
              "test_the_physics_checks_fail_when_bf16_and_fp16_are_swapped",
              "test_grpo_engines_run_in_their_precisions",
              "test_sampler_dial_orders_the_mismatch_and_the_runs_are_evaluated",
              "test_moe_routing_flips_follow_precision")
TESTS = " or ".join(TEST_NAMES)


def other_kernels(flags: set[str]) -> dict:
    """Environment that makes torch pick another kernel set than its default on a CPU
    with `flags`."""
    if flags & {"amx_bf16", "avx512_bf16"}:  # oneDNN's default uses bf16 instructions
        return {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    if "avx512f" in flags:
        return {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    return {"ATEN_CPU_CAPABILITY": "default"}


def verdicts(results: Path) -> dict:
    """Ledger verdict per claim number, for the claims of STEMS, judged on the results
    in `results`."""
    from . import ledger
    from labutils.results import load_all

    runs = load_all(results)
    return {i: ledger._evaluate(claim, runs)[1].split(" (")[0]
            for i, claim in enumerate(ledger.CLAIMS, 1)
            if claim.chapter in STEMS and claim.device == "cpu"}


def main() -> int:
    from . import pipeline

    start = time.perf_counter()
    from labutils.env import cpu_flags

    env = other_kernels(cpu_flags())
    os.environ.update(env)
    print("second kernel set: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    build = pipeline.BUILD / "kernels"
    shutil.rmtree(build / "results", ignore_errors=True)
    pipeline.execute_all(list(STEMS), "cpu", jobs=2, build=build)
    from labutils.env import kernel_set

    for stem in STEMS:
        data = json.loads((build / "results" / f"{stem}.json").read_text())
        kernels = data["env"].get("kernels", kernel_set())
        print(f"{stem}: {data['seconds']:.0f} s under {kernels}")
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_chapters.py", "-k", TESTS],
        cwd=pipeline.ROOT,
        env={**os.environ, "LAB_CHECK_RESULTS": str(build / "results")})
    default, other = verdicts(pipeline.BUILD / "results"), verdicts(build / "results")
    changed = {i: (default[i], other[i]) for i in default if default[i] != other[i]}
    for i, (a, b) in changed.items():
        print(f"ledger claim {i}: {a} under the default kernels, {b} under {env}")
    print(f"{len(default)} ledger verdicts compared, {len(changed)} changed; "
          f"{time.perf_counter() - start:.0f} s")
    return 1 if tests.returncode or changed else 0


if __name__ == "__main__":
    sys.exit(main())
