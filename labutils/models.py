"""The model lab: a character tokenizer, tiny dense and MoE causal LMs, their warm-up and cache.

Models are built from config, warmed up on the scratchpad task, saved with `save_pretrained`
and always loaded back through `AutoModelForCausalLM` / `AutoTokenizer`, so chapters exercise
the same loading code a real checkpoint would. Builds are cached on disk by a hash of
everything that determines them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import random
import time
from pathlib import Path

import torch

from . import checkpoint, pretrained, task
from .profiles import ModelSize, Profile, WarmupPlan

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARACTERS = "0123456789+*=:;"
KINDS = ("dense", "moe")
LAB_FILE = "lab.json"


def _quiet_transformers() -> None:
    """Loading bars for a 1 MB model are noise in an executed chapter."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast`: one token per character, left padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left", model_max_length=1 << 16,
    )


def build_config(size: ModelSize, tokenizer):
    """A Qwen2 config (dense) or a Mixtral config (MoE, top-k routing) of the given size."""
    from transformers import MixtralConfig, Qwen2Config

    common = dict(
        vocab_size=len(tokenizer), hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size, num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads, num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=size.max_positions, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    if size.num_experts:
        return MixtralConfig(num_local_experts=size.num_experts,
                             num_experts_per_tok=size.experts_per_token, **common)
    return Qwen2Config(**common)


def cache_root() -> Path:
    """Where built models live (`LAB_CACHE` overrides)."""
    return Path(os.environ.get("LAB_CACHE", Path.home() / ".cache" / "precision-lab")) / "models"


def pretrained_root() -> Path:
    """Where the real model is converted: the lab cache, or `LAB_PRETRAINED_CACHE` (shared by test runs whose
    lab cache is their own, so that the conversion happens once)."""
    shared = os.environ.get("LAB_PRETRAINED_CACHE")
    return Path(shared) if shared else cache_root()


def build_key(kind: str, size: ModelSize, plan: WarmupPlan, seed: int) -> str:
    """Hash of everything that determines a build, the code that builds it included."""
    recipe = json.dumps(
        {"kind": kind, "size": dataclasses.asdict(size), "warmup": dataclasses.asdict(plan),
         "seed": seed, "chars": CHARACTERS, "specials": SPECIAL_TOKENS,
         "code": "".join(inspect.getsource(f) for f in (build_tokenizer, build_config, _encode_batch, warm_up, _build,
                                                        task.sample_problems, task.Problem))},
        sort_keys=True,
    )
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def _encode_batch(tokenizer, problems: list[task.Problem]):
    """Right-padded prompt+completion+EOS ids, with labels only on the completion."""
    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    targets = [tokenizer(p.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for p in problems]
    width = max(len(a) + len(b) for a, b in zip(prompts, targets))
    ids = torch.full((len(problems), width), tokenizer.pad_token_id)
    labels = torch.full((len(problems), width), -100)
    mask = torch.zeros((len(problems), width), dtype=torch.long)
    for row, (a, b) in enumerate(zip(prompts, targets)):
        n = len(a) + len(b)
        ids[row, :n] = torch.tensor(a + b)
        labels[row, len(a):n] = torch.tensor(b)
        mask[row, :n] = 1
    return ids, mask, labels


def warm_up(model, tokenizer, plan: WarmupPlan, seed: int, progress: bool = True) -> list[float]:
    """Supervised training on the task so the policy is peaked and partly right; returns losses."""
    from tqdm.std import tqdm

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=plan.lr, total_steps=plan.steps,
                                                   pct_start=0.1)
    model.train()
    losses = []
    for _ in tqdm(range(plan.steps), desc="warm-up", disable=not progress, mininterval=5):
        problems = task.sample_problems(rng, plan.batch_size, plan.min_walk, plan.max_walk)
        device = next(model.parameters()).device
        ids, _, labels = (t.to(device) for t in _encode_batch(tokenizer, problems))
        loss = model(input_ids=ids, labels=labels).loss  # right-padded: causal attention needs no mask
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[task.Problem], batch_size: int = 128) -> float:
    """Share of problems whose greedy completion has the right final answer."""
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True).to(device)
        longest = max(task.completion_length(p.steps) for p in chunk) + 1
        out = model.generate(**enc, max_new_tokens=longest, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(task.exact_match(t, p.answer) for t, p in zip(texts, chunk))
    return correct / len(problems)


def eval_problems(profile: Profile, seed: int = 0) -> list[task.Problem]:
    """The fixed held-out problems a model is scored on (a seed apart from training's)."""
    r = profile.task
    return task.sample_problems(random.Random(10_000 + seed), r.eval_problems, r.min_walk, r.max_walk)


def _build(kind: str, size: ModelSize, plan: WarmupPlan, seed: int, target: Path, device: str = "cpu") -> None:
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_config(build_config(size, tokenizer), dtype=torch.float32).to(device)
    start = time.perf_counter()
    losses = warm_up(model, tokenizer, plan, seed)
    seconds = time.perf_counter() - start
    meta = {"kind": kind, "size": dataclasses.asdict(size), "warmup": dataclasses.asdict(plan),
            "seed": seed, "warmup_seconds": seconds, "final_loss": losses[-1],
            "loss_curve": losses[:: max(1, len(losses) // 100)]}
    checkpoint.save(model, tokenizer, target, LAB_FILE, meta)


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in (LAB_FILE, "config.json", "model.safetensors",
                                                    "tokenizer.json"))


def lab_model_dir(kind: str, profile: Profile, seed: int = 0, rebuild: bool = False) -> Path:
    """Directory of the lab's `kind` model for this profile and seed, built on first use."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a lab model; choose one of {KINDS}.")
    size, plan = (profile.dense, profile.warmup) if kind == "dense" else (profile.moe, profile.moe_warmup)
    path = cache_root() / f"{kind}-{profile.name}-s{seed}-{build_key(kind, size, plan, seed)}"
    if rebuild or not _is_complete(path):
        print(f"building the lab's {kind} model into {display_path(path)} (one-time warm-up)")
        _build(kind, size, plan, seed, path, profile.device)
    return path


def display_path(path) -> str:
    """A lab model's folder as a reader should see it: under $LAB_CACHE (or ~/.cache/precision-lab)."""
    path = Path(path)
    try:
        return f"<lab cache>/models/{path.relative_to(cache_root())}"
    except ValueError:
        return str(path)  # a model the reader passed in: their own path


def lab_metadata(path: Path) -> dict:
    """The build record (`lab.json`) saved beside a lab model."""
    return json.loads((Path(path) / LAB_FILE).read_text())


def resolve_model(model_id: str | None, kind: str, profile: Profile, seed: int = 0) -> str:
    """`model_id` when given (local directory or hub id, or `pretrained.NAME` for the lab's real model,
    converted on first use), else the lab model's directory."""
    if model_id is None:
        return str(lab_model_dir(kind, profile, seed))
    if model_id == pretrained.NAME:
        if kind == "moe":
            raise ValueError(f"model_id={model_id!r} is a dense model; the MoE chapter needs a mixture-of-experts "
                             "checkpoint, or None for the lab's MoE model.")
        return str(pretrained.model_dir(pretrained_root()))
    looks_local = model_id.startswith((".", "/", "~"))  # hub ids look like "org/name"
    local = Path(model_id).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"model_id={model_id!r} is a directory without config.json; "
                                    "point it at a save_pretrained directory.")
        if kind == "moe":
            _check_experts(model_id, str(local))
        return str(local)
    if looks_local:
        raise FileNotFoundError(f"model_id={model_id!r} does not exist; pass an existing "
                                "save_pretrained directory or a hub id such as 'Qwen/Qwen2.5-0.5B'.")
    if kind == "moe":
        _check_experts(model_id, model_id)
    return model_id  # a hub id: from_pretrained fetches it (the only network access)


def experts_of(config) -> tuple[int, int]:
    """(experts per layer, experts per token) of a transformers config; (0, 0) for a dense model."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    return int(experts), int(getattr(config, "num_experts_per_tok", 0) or 0)


def _check_experts(model_id: str, path: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if experts_of(config)[0] < 2:
        raise ValueError(f"model_id={model_id!r} is a dense {config.model_type} model with no experts; this "
                         "chapter needs a mixture-of-experts checkpoint (Mixtral, Qwen-MoE, OLMoE) or None.")


def complete_special_tokens(model, tokenizer) -> list[str]:
    """Give a checkpoint what the engines need: an EOS id, a pad id (EOS when it has none), left padding.

    Many Llama- and Qwen-family checkpoints ship without a pad token, pad on the right and leave
    `pad_token_id` out of their config. Returns what was filled in, for one line of report.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {model.config.name_or_path!r} has no EOS token; completions end "
                         "at EOS here: set tokenizer.eos_token, or pick a checkpoint whose tokenizer has one.")
    rows = model.get_input_embeddings().num_embeddings
    if tokenizer.eos_token_id >= rows:
        raise ValueError(f"the tokenizer's EOS id {tokenizer.eos_token_id} is outside the model's {rows} "
                         "embeddings; the tokenizer does not belong to this model.")
    filled = []
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id >= rows:  # none, or one the model never saw
        tokenizer.pad_token = tokenizer.eos_token
        filled.append(f"pad token = EOS ({tokenizer.eos_token!r})")
    if tokenizer.padding_side != "left":  # batched generation continues every row at the same position
        tokenizer.padding_side = "left"
        filled.append("padding on the left")
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is None:
            continue
        if config.pad_token_id is None or config.pad_token_id >= rows:
            config.pad_token_id = tokenizer.pad_token_id
        if config is model.config and not isinstance(config.eos_token_id, int):
            # the engines stop at one id: the tokenizer's EOS (a chat model's end of turn), not the first of a list
            config.eos_token_id = tokenizer.eos_token_id
        elif config.eos_token_id is None:  # generation keeps a list of stop ids where it has one (trl reads it)
            config.eos_token_id = tokenizer.eos_token_id
    return filled


def load(model_id: str | None = None, kind: str = "dense", profile: Profile | None = None,
         seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", **kwargs):
    """(model, tokenizer) through the Auto classes; a corrupt lab cache is rebuilt once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    if model_id is None and profile is None:
        raise ValueError("load() needs a profile (labutils.profiles.resolve) when model_id is None.")
    path = resolve_model(model_id, kind, profile, seed)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # our own cache: any unreadable file means rebuild it
        if model_id is not None:
            raise
        print(f"the cached lab model at {path} could not be loaded ({err}); rebuilding it")
        path = str(lab_model_dir(kind, profile, seed, rebuild=True))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
    if model_id is not None:
        filled = complete_special_tokens(model, tokenizer)
        if filled:
            print(f"{model_id}: {', '.join(filled)}")
    if "device_map" not in kwargs and "quantization_config" not in kwargs:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    """`python -m labutils.models dense --profile cpu`: build (or find) one of the lab's models."""
    import argparse

    from .profiles import resolve

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("kind", choices=(*KINDS, "real"))
    parser.add_argument("--profile", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.kind == "real":
        print(f"the lab's real model: {display_path(resolve_model(pretrained.NAME, 'dense', None))}")
        return
    print(f"the lab's {args.kind} model: {display_path(lab_model_dir(args.kind, resolve(args.profile), args.seed))}")


if __name__ == "__main__":
    main()
