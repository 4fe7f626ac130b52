"""Does a GRPO update computed on mismatched samples keep the on-policy direction? (chapter 5c)

At fixed weights, SmolLM2-135M-Instruct in fp32 is the trainer and the policy π. Each batch draws
`prompts` "repeat this number" requests (chapter 5's task) × `group` completions of exactly `length`
tokens at T = 1, once from an fp32 sampler (π's own samples) and once from every other sampler μ.
For each sample set the trainer computes trl's GRPO update at ratio 1: trl's group advantages
(`scale_rewards="group"`), the "dapo" normalisation (the batch's token count), and optionally trl's
importance-sampling correction of the sampler (four modes at trl's defaults) or token-level TIS at
the book's cap. The update is the gradient of the trainer's last `blocks` decoder blocks and final
norm (the backward through the rest of the model is what a CPU cannot afford for every sampler and
correction), count-sketched to `sketch` numbers (inner products unbiased, error ≈ 1/√sketch of the
norms' product).

From the updates of independent batches, unbiased cross-batch products give, per sampler and correction,
ρ = ⟨ḡ_μ, ḡ_π⟩ / ‖ḡ_π‖² (how much of the on-policy update survives) and the orthogonal share
‖ḡ_μ − ρ ḡ_π‖² / ‖ḡ_π‖², each with a jackknife standard error over batches. The dose is the exact
KL[μ‖π] over the vocabulary summed over a completion's tokens, along μ's samples.

Coupling: EOS is banned at every position (as a serving stack's `min_tokens` bans it), for the sampler and
the trainer alike, so the policy measured is the EOS-banned one. The samplers, seeded alike, draw by
Gumbel-max from the same noise for the same row and step (`rollout.sample_step`): two samplers' completions
agree until the first position where their distributions move the argmax, so the difference of their
updates, ρ − 1 = ⟨ḡ_μ − ḡ_π, ḡ_π⟩ / ‖ḡ_π‖², has noise only from the rows that split, noise that shrinks with
the dose. Two fp32 samplers give the floors: `fp32_kernel`, π's weights and seeds under another attention
kernel (transformers' SDPA instead of the engines' decode attention: rounding-level differences, coupled),
and `fp32_replicate`, π's weights and kernels on another seed stream: the uncoupled noise floor. ρ
measured against the replicate's batches (instead of π's coupled batches) is the uncoupled estimate at the
same number of completions.

    python -m labutils.update_direction        # results/long/05c_update_direction.json (make direction)
"""
from __future__ import annotations

import argparse
import ctypes
import math
import time
from pathlib import Path

import torch

from . import committed, pretrained, real_rl, rollout, sampler_precision, sampling_correction
from .mismatch import token_kl
from .mismatch_rl import TIS_CLIP


RUN = committed.Run("05c_update_direction", module="update_direction", make="make direction")
SAMPLERS = ("fp32_kernel", "fp32_replicate", "fp16", "bf16", "fp8", "m5", "m4", "m3", "m2")
FLOORS = ("fp32_kernel", "fp32_replicate")  # fp32 samplers: no correction to apply, no dose to speak of
CORRECTIONS = ("none", *sampling_correction.MODES, "tis")
PLAN = {"prompts": 6, "group": 8, "length": 24, "blocks": 2, "sketch": 2 ** 19, "seed": 5000,
        "samplers": SAMPLERS, "corrections": CORRECTIONS, "tis_clip": TIS_CLIP,
        # pre-registered before the main run: the smallest loss of direction that matters, the test's level,
        # the dose the paper's bf16 reaches at 1K tokens (chapter 4b: 1.7 nats per 1K tokens), and the budget
        "smallest_drop": 0.05, "alpha": 0.05, "paper_dose": 1.7, "pilot_prompts": 4, "pilot_batches": 6,
        "budget_minutes": 50}
REPLICATE_SEED = 10 ** 6  # the replicate's seed stream starts this far from π's


class Trainer:
    """π: the fp32 policy, with gradients on its last `blocks` decoder blocks and its final norm only."""

    def __init__(self, model, blocks: int, sketch: int, seed: int):
        self.engine = rollout.TrainingEngine(model, torch.float32)
        self.model = self.engine.model
        layers = len(self.model.model.layers)
        trained = tuple(f"model.layers.{i}." for i in range(layers - blocks, layers)) + ("model.norm.",)
        self.params = []
        for name, p in self.model.named_parameters():
            p.requires_grad_(name.startswith(trained))
            if p.requires_grad:
                self.params.append(p)
        size = sum(p.numel() for p in self.params)
        g = torch.Generator().manual_seed(seed)
        self.bucket = torch.randint(sketch, (size,), generator=g)
        self.sign = torch.randint(2, (size,), generator=g).float() * 2 - 1
        self.sketch_size, self.size = sketch, size

    def logprobs(self, out: rollout.Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """log π of each completion token (with its graph) and of the whole vocabulary (detached), EOS banned
        at every position as the sampler banned it."""
        width, steps = max(map(len, out.prompt_ids)), out.completion_ids.shape[1]
        ids = torch.full((len(out.prompt_ids), width), self.engine.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(out.prompt_ids):
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt), 1
        ids = torch.cat([ids, out.completion_ids], 1)
        mask = torch.cat([mask, torch.ones_like(out.completion_ids)], 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                            logits_to_keep=steps + 1).logits[:, :-1].float()
        eos = torch.zeros(logits.shape[-1], dtype=torch.bool)
        eos[self.engine.eos_id] = True
        vocab = torch.log_softmax(logits.masked_fill(eos, -math.inf), -1)
        return vocab.gather(-1, out.completion_ids[..., None]).squeeze(-1), vocab.detach()

    def sketch(self, objective: torch.Tensor) -> torch.Tensor:
        """The count sketch of the gradient of `objective` with respect to the trained parameters."""
        grads = torch.autograd.grad(objective, self.params, retain_graph=True)
        flat = torch.cat([g.reshape(-1) for g in grads])
        return torch.zeros(self.sketch_size).index_add_(0, self.bucket, flat * self.sign)


def advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """trl's group advantages (`scale_rewards="group"`): reward minus its group's mean, over the group's std."""
    from trl.trainer.utils import nanstd

    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    return (rewards - mean) / (nanstd(grouped, dim=1).repeat_interleave(group) + 1e-4)


def correction_weights(log_ratio: torch.Tensor, correction: str) -> tuple[torch.Tensor, float]:
    """Each token's weight [B, T] (1 uncorrected, trl's mode at trl's defaults, or token TIS at the book's cap)
    and the share of tokens (token modes) or completions (sequence modes) it clipped or masked."""
    if correction == "none":
        return torch.ones_like(log_ratio), 0.0
    mode, bounds = ("token_truncate", (None, TIS_CLIP)) if correction == "tis" else (correction, None)
    if bounds is None:
        trl = sampling_correction.defaults()
        bounds = (trl["clip_min"], trl["clip_max"])
    w = sampling_correction.weights(log_ratio, torch.ones_like(log_ratio), mode, *bounds)
    raw = torch.exp(log_ratio.sum(-1, keepdim=True) if mode.startswith("sequence") else log_ratio)
    return w.expand_as(log_ratio), float((w != raw).double().mean())


def updates(trainer: Trainer, out: rollout.Rollout, answers: list[int], tokenizer, group: int,
            corrections: tuple[str, ...]) -> dict:
    """One sample set's sketched GRPO update under each correction, its dose per completion and its rewards."""
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    rewards = torch.tensor(real_rl.reward(texts, answers))
    adv = advantages(rewards, group)
    logp, vocab = trainer.logprobs(out)
    log_ratio = logp.detach() - out.logprobs  # log π − log μ per token, as trl computes its correction
    tokens = logp.numel()  # "dapo": the batch's completion tokens
    kl = token_kl(out.vocab_logprobs, vocab).float()
    found = {"dose": kl.sum(-1), "dose_by_position": kl.mean(0), "reward": rewards,
             "seq_log_ratio": log_ratio.sum(-1), "sketch": {}, "cut": {}}
    for correction in corrections:
        w, found["cut"][correction] = correction_weights(log_ratio, correction)
        found["sketch"][correction] = trainer.sketch((adv[:, None] * w * logp).sum() / tokens)
    return found


def sample(engine, ids: list[list[int]], length: int, seed: int) -> rollout.Rollout:
    """`length` tokens per row, EOS banned at every position: every row alive at every step (coupled draws)."""
    return engine.sample(ids, length, length, generator=torch.Generator().manual_seed(seed), keep_vocab=True)


def run_batches(model, tokenizer, plan: dict, batches: int, prompts: int, first_seed: int,
                progress=print, minutes: float | None = None) -> dict:
    """Every sampler's sketched updates and doses over `batches` independent batches; given `minutes`, fewer
    where the next batch would not end within them (at least 3; the clock decides, never the results)."""
    trainer = Trainer(model, plan["blocks"], plan["sketch"], plan["seed"])
    names = ("fp32", *plan["samplers"])
    engines = {name: sampler_precision.engine(model, "fp32" if name in FLOORS else name) for name in names}
    if "fp32_kernel" in engines:
        engines["fp32_kernel"].model.set_attn_implementation("sdpa")
    kept = {name: {"sketch": {}, "dose": [], "dose_by_position": [], "reward": [], "seq_log_ratio": [], "cut": {},
                   "identical": []} for name in names}
    seconds = {name: 0.0 for name in names}
    began = time.time()
    for b in range(batches):
        spent = time.time() - began
        if minutes is not None and b >= 3 and spent + spent / b > 60 * minutes:
            batches = b
            break
        numbers = real_rl.problems(prompts, first_seed + b)
        answers = [n for n in numbers for _ in range(plan["group"])]
        ids = [tokenizer(real_rl.prompt_text(tokenizer, n), add_special_tokens=False)["input_ids"] for n in answers]
        for name in names:
            started = time.time()
            seed = first_seed + b + (REPLICATE_SEED if name == "fp32_replicate" else 0)
            out = sample(engines[name], ids, plan["length"], seed)
            if name == "fp32":
                pi_ids = out.completion_ids
            kept[name]["identical"].append((out.completion_ids == pi_ids).all(-1).float())  # rows that never split
            corrections = plan["corrections"] if name != "fp32" and name not in FLOORS else ("none",)
            found = updates(trainer, out, answers, tokenizer, plan["group"], corrections)
            for key in ("dose", "dose_by_position", "reward", "seq_log_ratio"):
                kept[name][key].append(found[key])
            for correction, vector in found["sketch"].items():
                kept[name]["sketch"].setdefault(correction, []).append(vector)
                kept[name]["cut"].setdefault(correction, []).append(found["cut"][correction])
            seconds[name] += time.time() - started
        progress(f"batch {b + 1}/{batches}: " + ", ".join(f"{n} {float(torch.cat(kept[n]['dose']).mean()):.3g}"
                                                           for n in names))
    return {"kept": kept, "seconds": seconds, "batches": batches, "completions": batches * prompts * plan["group"]}


def _cross(x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The mean of ⟨x_b, y_b'⟩ over batch pairs b ≠ b' (unbiased for ⟨E x, E y⟩ when batches are independent),
    and its leave-one-batch-out values."""
    m = x.double() @ y.double().T
    n = len(m)
    off = m.sum() - m.trace()
    loo = (off - m.sum(0) - m.sum(1) + 2 * m.diagonal()) / ((n - 1) * (n - 2))
    return float(off / (n * (n - 1))), loo


def _jackknife(full: float, loo: torch.Tensor) -> float:
    n = len(loo)
    return float(math.sqrt((n - 1) / n * float(((loo - loo.mean()) ** 2).sum())))


def direction(vectors: torch.Tensor, reference: torch.Tensor) -> dict:
    """ρ and the orthogonal share of the mean of `vectors` against the mean of `reference` ([B, sketch] each),
    with jackknife standard errors over batches."""
    rr, rr_loo = _cross(reference, reference)
    vr, vr_loo = _cross(vectors, reference)
    vv, vv_loo = _cross(vectors, vectors)
    rho, rho_loo = vr / rr, vr_loo / rr_loo
    orth, orth_loo = (vv - vr ** 2 / rr) / rr, (vv_loo - vr_loo ** 2 / rr_loo) / rr_loo
    return {"rho": rho, "rho_se": _jackknife(rho, rho_loo), "orth": orth, "orth_se": _jackknife(orth, orth_loo)}


def _per_prompt_mean_se(values: list[torch.Tensor], group: int) -> tuple[float, float]:
    """Mean and standard error with the prompt (a group of completions) as the independent unit."""
    per_prompt = torch.cat(values).view(-1, group).mean(1).double()
    return float(per_prompt.mean()), float(per_prompt.std() / math.sqrt(len(per_prompt)))


def gram(found: dict, chunk: int = 1 << 17) -> dict:
    """Every sketched update's inner product with every other, batch by batch, so that other estimators can be
    computed from the committed file: labels "sampler/correction/batch" and the matrix, row by row. Summed in
    float64 over slices of the sketch, so that no float64 copy of every update is ever held at once."""
    labels, vectors = [], []
    for name, record in found["kept"].items():
        for correction, kept in record["sketch"].items():
            for b, vector in enumerate(kept):
                labels.append(f"{name}/{correction}/{b}")
                vectors.append(vector)
    matrix = torch.zeros(len(vectors), len(vectors), dtype=torch.float64)
    for start in range(0, vectors[0].numel(), chunk):
        part = torch.stack([v[start:start + chunk] for v in vectors]).double()
        matrix += part @ part.T
    return {"labels": labels, "matrix": matrix.tolist()}


def raw(found: dict) -> dict:
    """Per sampler, per completion: dose, reward and log π/μ summed over the completion; and the mean token KL
    by position."""
    return {name: {"dose": torch.cat(r["dose"]).tolist(), "reward": torch.cat(r["reward"]).tolist(),
                   "seq_log_ratio": torch.cat(r["seq_log_ratio"]).tolist(),
                   "dose_by_position": torch.stack(r["dose_by_position"]).mean(0).tolist()}
            for name, r in found["kept"].items()}


def analyse(found: dict, plan: dict) -> dict:
    """Per sampler: its dose, its reward, and ρ and the orthogonal share for each correction (coupled against
    π's batches), with ρ uncoupled (against the fp32 replicate's batches) beside it."""
    kept = found["kept"]
    pi = torch.stack(kept["fp32"]["sketch"]["none"])
    replicate = torch.stack(kept["fp32_replicate"]["sketch"]["none"])
    out = {"samplers": {}}
    for name, record in kept.items():
        dose, dose_se = _per_prompt_mean_se(record["dose"], plan["group"])
        reward, reward_se = _per_prompt_mean_se(record["reward"], plan["group"])
        identical = float(torch.cat(record["identical"]).mean())
        entry = {"dose": dose, "dose_se": dose_se, "reward": reward, "reward_se": reward_se,
                 "identical_share": identical, "corrections": {}}
        for correction, vectors in record["sketch"].items():
            stacked = torch.stack(vectors)
            measured = direction(stacked, pi) if name != "fp32" else {}
            if name != "fp32_replicate":
                uncoupled = direction(stacked, replicate)
                measured |= {"rho_uncoupled": uncoupled["rho"], "rho_uncoupled_se": uncoupled["rho_se"]}
            measured["cut_share"] = sum(record["cut"][correction]) / len(record["cut"][correction])
            entry["corrections"][correction] = measured
        out["samplers"][name] = entry
    if set(FLOORS) <= set(kept):  # what coupling buys at the floor: the uncoupled error over the coupled one
        coupled = out["samplers"]["fp32_kernel"]["corrections"]["none"]["rho_se"]
        uncoupled = out["samplers"]["fp32_replicate"]["corrections"]["none"]["rho_se"]
        # None where no coupled row split: the two updates are the same vectors and the error is exactly 0
        out["coupling_gain"] = uncoupled / coupled if coupled > 0 else None
    return out


def power(se: float, effect: float, alpha: float) -> float:
    """The chance a two-sided level-`alpha` z-test sees a true change of `effect`, given its standard error."""
    from statistics import NormalDist

    if not math.isfinite(se) or se <= 0:
        return float("nan")
    z = NormalDist().inv_cdf(1 - alpha / 2)
    return NormalDist().cdf(effect / se - z) + NormalDist().cdf(-effect / se - z)


def completions_for(se: float, completions: int, effect: float, alpha: float, target: float = 0.8) -> int:
    """Completions per sampler that give `target` power for `effect`, scaling an SE measured at `completions`."""
    from statistics import NormalDist

    if not math.isfinite(se) or se <= 0:
        return None
    needed_se = effect / (NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(target))
    return math.ceil(completions * (se / needed_se) ** 2)


def preregister(pilot: dict, plan: dict, seconds_per_batch: float) -> dict:
    """From the pilot: the sampler nearest above the paper's dose, the completions 80% power needs there, and
    the batches the budget should afford (fixed before the main run; the main run stops by the clock)."""
    samplers = pilot["samplers"]
    above = [n for n in plan["samplers"] if samplers[n]["dose"] >= plan["paper_dose"]]
    at_paper = min(above, key=lambda n: samplers[n]["dose"]) if above else max(plan["samplers"], key=lambda n: samplers[n]["dose"])
    se = samplers[at_paper]["corrections"]["none"]["rho_se"]
    pilot_completions = plan["pilot_batches"] * plan["pilot_prompts"] * plan["group"]
    pilot_seconds = seconds_per_batch * plan["pilot_batches"] * plan["pilot_prompts"] / plan["prompts"]
    batches = max(3, int((plan["budget_minutes"] * 60 - pilot_seconds) // seconds_per_batch))
    main_completions = batches * plan["prompts"] * plan["group"]
    expected_se = se * math.sqrt(pilot_completions / main_completions)
    return {"at_paper_dose": at_paper, "pilot_rho_se": se, "pilot_completions": pilot_completions,
            "completions_for_80": completions_for(se, pilot_completions, plan["smallest_drop"], plan["alpha"]),
            "batches": batches, "completions": main_completions, "expected_rho_se": expected_se,
            "expected_power": power(expected_se, plan["smallest_drop"], plan["alpha"])}


def load() -> tuple[dict | None, str | None]:
    """The committed run and, where this checkout cannot show it, why."""
    return RUN.load(PLAN, pretrained.identity())


def _return_large_buffers() -> None:
    """Hand every buffer above 4 MB back to the system when it is freed. glibc otherwise raises its mmap
    threshold to the largest buffer freed (up to 32 MB), so the samplers' per-step 10-20 MB buffers come from
    the heap, which fragments: ten samplers' batches then grew the process by about 2 GB each until the
    run was killed for memory on 24 GB. (A no-op where the C library is not glibc.)"""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD; setting it also stops glibc from raising it


def main(argv: list[str] | None = None) -> None:
    _return_large_buffers()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=None)
    args = parser.parse_args(argv)
    from . import models

    model, tokenizer = models.load(pretrained.NAME)
    began, code = time.time(), RUN.fingerprint(PLAN)  # the code as it starts, not as it ends
    pilot_raw = run_batches(model, tokenizer, PLAN, PLAN["pilot_batches"], PLAN["pilot_prompts"], PLAN["seed"])
    pilot = analyse(pilot_raw, PLAN)
    per_completion = sum(pilot_raw["seconds"].values()) / pilot_raw["completions"]
    plan_fixed = preregister(pilot, PLAN, per_completion * PLAN["prompts"] * PLAN["group"])
    print("pre-registered:", plan_fixed)
    main_raw = run_batches(model, tokenizer, PLAN, plan_fixed["batches"], PLAN["prompts"], PLAN["seed"] + 1000,
                           minutes=PLAN["budget_minutes"] - (time.time() - began) / 60)
    result = analyse(main_raw, PLAN)
    at = result["samplers"][plan_fixed["at_paper_dose"]]["corrections"]["none"]
    result |= {"pilot": pilot, "preregistered": plan_fixed, "completions": main_raw["completions"],
               "batches": main_raw["batches"],
               "gram": gram(main_raw), "per_completion": raw(main_raw),
               "seconds": main_raw["seconds"],
               "achieved_power": power(at["rho_se"], PLAN["smallest_drop"], PLAN["alpha"]),
               "completions_for_80": completions_for(at["rho_se"], main_raw["completions"], PLAN["smallest_drop"],
                                                     PLAN["alpha"])}
    target = RUN.write(result, PLAN, pretrained.identity(), began, args.target, code)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
