"""The mismatch doctor: how far one trainer's π is from one sampler's μ on your model, measured by the book's engines.

`python -m labutils.doctor --model smollm2-135m-instruct --sampler torch:bf16 --trainer torch:fp32` samples
`--sequences` completions of exactly `--tokens` tokens each (EOS banned until then) from the model's chat
prompts with the sampler, keeping log μ of the whole vocabulary, and rescores them with the trainer
(`--trainer-mode autocast`: fp32 weights under `torch.autocast`, as the book's RL runs train; `pure`: the
weights cast whole). It reports the exact token KL[μ‖π] and its k3 estimate with standard errors over
sequences, where in the sequence and at which probabilities the KL sits, how the sequence log-weight drifts
and spreads with length, what trl's importance-sampling modes make of these samples, how far the largest
activation of each layer sits below fp16's largest value (chapter 8's probe), what trl, verl and
NeMo-RL would log for them, and a verdict against the book's own measurements where it has some. All of it
goes to a JSON file, with a figure beside it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from . import (book_measurements, clusters, framework_metrics, grpo, llamacpp, rollout, sampler_precision,
               sampling_correction, serving_options)

ENGINES = ("torch", "llama.cpp")  # llama.cpp samples only: the trainer is the one that takes gradients
TRAINER_DTYPES = tuple(rollout.DTYPES)  # fp32, bf16, fp16
TRAINER_MODES = ("autocast", "pure")
MICRO_BATCH = 4  # sequences per teacher-forced forward: its fp32 logits are part of the memory estimate
SD_LENGTHS = (256, 512, 1024)  # where the prefix log-ratio's spread is read, as chapter 4b reads it
MU_EDGES = [0.0, 0.01, 0.1, 0.5, 0.9, 1.0]  # buckets of the sampled token's probability under μ, as in 4b
MIN_TOKENS = 16  # the drift fit reads a prefix every tokens/16 positions: at least one token apart
KL_CHUNK = 256  # positions mismatch.token_kl holds in float64 at once


def _refuse(sentence: str) -> SystemExit:
    """The exit for a bad request: one sentence, non-zero status."""
    return SystemExit(sentence)


def parse_engine(text: str, flag: str) -> tuple[str, str]:
    """`ENGINE:DTYPE` split in two, once the engine is one this doctor runs on that side."""
    engine, colon, dtype = text.partition(":")
    if not colon or not engine or not dtype:
        raise _refuse(f"{flag} {text!r} must be ENGINE:DTYPE, for example {flag} torch:bf16.")
    if engine not in ENGINES:
        raise _refuse(f"engine {engine!r} in {flag} {text} is not one this doctor runs; use torch or llama.cpp.")
    if engine == "llama.cpp" and flag == "--trainer":
        raise _refuse(f"--trainer {text}: llama.cpp samples but does not train; the trainer is torch "
                      "(--trainer torch:fp32, torch:bf16 or torch:fp16).")
    if engine == "llama.cpp":
        try:
            llamacpp.check_kind(dtype)
            llamacpp.require()
        except (ValueError, ModuleNotFoundError) as err:
            raise _refuse(f"{flag} {text}: {err}") from None
    return engine, dtype


def _parser() -> argparse.ArgumentParser:
    """The command line's flags and their defaults."""
    from . import pretrained

    parser = argparse.ArgumentParser(prog="python -m labutils.doctor", description=__doc__.split("\n")[0],
                                     epilog="It runs the book's torch engines and llama.cpp (CPU), not your own "
                                            "serving engine or trainer: choose the engine and dtypes nearest "
                                            "yours, and compare its framework metrics with your logs.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=pretrained.NAME,
                        help=f"{pretrained.NAME} (the book's real model), a save_pretrained directory, a hub id, "
                             "or lab:dense / lab:moe (the lab's toy models)")
    parser.add_argument("--sampler", default="torch:bf16",
                        help="ENGINE:DTYPE: torch:fp32, bf16, fp16, fp8, fp8_channel or m2 … m10 (emulated), or "
                             f"llama.cpp:{', '.join(llamacpp.KINDS)} (the real model only)")
    parser.add_argument("--trainer", default="torch:fp32", help="torch:DTYPE with DTYPE fp32, bf16 or fp16")
    parser.add_argument("--trainer-mode", default="autocast", choices=TRAINER_MODES,
                        help="autocast: fp32 weights under torch.autocast (trl, accelerate); pure: the weights "
                             "cast whole to the dtype (FSDP's param_dtype, DeepSpeed's bf16)")
    parser.add_argument("--temperature", type=float, default=1.0, help="the sampler's; the trainer scores at it")
    parser.add_argument("--top-p", type=float, default=1.0, help="the sampler's nucleus (torch samplers); the "
                                                                 "trainer scores the full distribution")
    parser.add_argument("--logprobs", default="processed", choices=("processed", "raw"),
                        help="log μ as the sampler reports it: after its temperature, or raw (vLLM V1's default)")
    parser.add_argument("--fp32-head", default="none", choices=("none", "sampler", "trainer", "both"),
                        help="compute the LM head in fp32 on that side (torch engines)")
    parser.add_argument("--lora", type=float, default=0.0, metavar="SIZE",
                        help="a random LoRA adapter whose product is SIZE × each decoder weight's norm (e.g. "
                             "0.01): merged into the sampler, unmerged in the trainer; 0 for none")
    parser.add_argument("--lora-rank", type=int, default=16, help="the adapter's rank, with --lora")
    parser.add_argument("--flash-attention", default="auto", choices=tuple(llamacpp.FLASH_ATTENTION),
                        help="llama.cpp's flash attention: auto (its default, F16 attention) or off")
    parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH,
                        help="sequences per trainer forward (1: each scored alone)")
    parser.add_argument("--tokens", type=int, default=256, help="completion tokens per sequence, EOS banned")
    parser.add_argument("--sequences", type=int, default=4,
                        help="completions, one per chat request; every error is taken over them (8 or more "
                             "for a verdict that can tell the book's numbers apart)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's random numbers")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--json", type=Path, default=Path("doctor.json"), help="where the whole report goes")
    parser.add_argument("--figure", type=Path, default=None, help="default: beside the JSON, as .png")
    return parser


def check_options(args: argparse.Namespace, sampler_engine: str) -> None:
    """The stack options (top-p, raw log-probabilities, fp32 head, LoRA, micro-batch), checked; one sentence."""
    if not 0 < args.top_p <= 1:
        raise _refuse(f"--top-p {args.top_p} must be above 0 and at most 1.")
    if args.top_p < 1 and args.logprobs == "raw":
        raise _refuse("--logprobs raw cannot be recovered from a truncated distribution; drop --top-p or "
                      "use --logprobs processed.")
    if args.micro_batch < 1:
        raise _refuse(f"--micro-batch {args.micro_batch} must be at least 1.")
    if not 0 <= args.lora < 1 or args.lora_rank < 1:
        raise _refuse(f"--lora {args.lora} must be a relative size in [0, 1) with --lora-rank at least 1.")
    if sampler_engine == "torch" and args.flash_attention != "auto":
        raise _refuse(f"--flash-attention {args.flash_attention} sets llama.cpp's attention, and the torch "
                      "sampler has none; drop it or use --sampler llama.cpp:bf16.")
    if sampler_engine == "llama.cpp":
        asked = [flag for flag, on in (("--top-p", args.top_p < 1), ("--lora", args.lora > 0),
                                       ("--fp32-head " + args.fp32_head, args.fp32_head in ("sampler", "both")))
                 if on]
        if asked:
            raise _refuse(f"{' and '.join(asked)} change the book's torch sampler, not llama.cpp's; "
                          "use a torch sampler (--sampler torch:bf16) for them.")


def _real_model_name() -> str:
    from . import pretrained

    return pretrained.NAME


def check_request(args: argparse.Namespace) -> dict:
    """The request's engines, dtypes and sizes, checked before anything heavy loads; one sentence where not."""
    sampler_engine, sampler_name = parse_engine(args.sampler, "--sampler")
    _, trainer_name = parse_engine(args.trainer, "--trainer")
    dial = None
    if sampler_engine == "torch":
        try:
            dial = sampler_precision.parse(sampler_name)
        except ValueError as err:
            raise _refuse(f"--sampler {args.sampler}: {err}") from None
    elif args.model != _real_model_name():
        try:
            llamacpp.check_model(None if args.model.startswith("lab:") else args.model)
        except ValueError as err:
            raise _refuse(f"--sampler {args.sampler}: {err}") from None
    if trainer_name not in TRAINER_DTYPES:
        raise _refuse(f"--trainer {args.trainer}: a trainer holds fp32, bf16 or fp16 weights, not {trainer_name!r}; "
                      "choose one of torch:fp32, torch:bf16, torch:fp16.")
    if args.tokens < MIN_TOKENS:
        raise _refuse(f"--tokens {args.tokens} is too short to fit the log-weight drift; "
                      f"ask for at least {MIN_TOKENS}.")
    if args.sequences < 2:
        raise _refuse(f"--sequences {args.sequences}: standard errors over sequences need at least 2.")
    if not args.temperature > 0:
        raise _refuse(f"--temperature {args.temperature} must be positive; sampling needs a distribution.")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise _refuse("--device cuda: torch sees no CUDA GPU on this machine; use --device cpu.")
    if sampler_engine == "llama.cpp" and device == "cuda":
        raise _refuse(f"--sampler {args.sampler}: the lab's llama.cpp is built for the CPU; add --device cpu.")
    check_options(args, sampler_engine)
    trainer_dtype = rollout.DTYPES[trainer_name]
    try:  # a matmul in each engine's dtype on this device (rollout.engine_dtype's probe)
        rollout.engine_dtype(dial.engine_dtype if dial else "fp32", device)
        rollout.engine_dtype(trainer_name, device)
    except (RuntimeError, ValueError) as err:
        raise _refuse(str(err)) from None
    autocast = args.trainer_mode == "autocast" and trainer_dtype != torch.float32
    if autocast:
        with torch.autocast(device, dtype=trainer_dtype):
            probe = torch.ones(2, 2, device=device)
            computed = (probe @ probe).dtype
        if computed != trainer_dtype:
            raise _refuse(f"torch.autocast on {device} does not compute in {trainer_name} here; "
                          "use --trainer-mode pure.")
    label = dial.label if dial else (f"llama.cpp {llamacpp.VERSION}: {llamacpp.PRECISION[sampler_name]}; "
                                     f"{llamacpp.ATTENTION[args.flash_attention]}")
    book_sampler = (sampler_name if dial else
                    args.sampler + ("" if args.flash_attention == "auto" else ":fa_off"))
    return {"dial": dial, "engine": sampler_engine, "sampler": sampler_name, "label": label,
            "book_sampler": book_sampler, "trainer": trainer_name,
            "trainer_dtype": trainer_dtype, "autocast": autocast, "device": device}


def available_memory() -> tuple[int, str]:
    """Bytes of memory available to this process now, and where the number comes from."""
    try:
        import psutil

        return int(psutil.virtual_memory().available), "psutil"
    except ImportError:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "/proc/meminfo"
    return 0, "unknown"


def full_vocab_bytes(sequences: int, tokens: int, vocab: int, micro_batch: int = MICRO_BATCH) -> int:
    """Bytes the exact KL holds at once: log μ and log π of every vocabulary entry at every position (fp32),
    one micro-batch of the trainer's fp32 logits, and the float64 chunk the KL is summed in."""
    return 4 * vocab * (2 * sequences * tokens + min(sequences, micro_batch) * tokens) + 3 * 8 * vocab * KL_CHUNK


def check_memory(sequences: int, tokens: int, vocab: int, device: str, micro_batch: int = MICRO_BATCH) -> int:
    """The bytes `full_vocab_bytes` asks for, after checking they fit; one sentence naming the flag where not."""
    need = full_vocab_bytes(sequences, tokens, vocab, micro_batch)
    have, _ = available_memory()
    if have and need > have:
        raise _refuse(f"the full-vocabulary log-probabilities of {sequences} sequences × {tokens} tokens "
                      f"(vocabulary {vocab:,}) need about {need / 1e9:.1f} GB and {have / 1e9:.1f} GB of memory is "
                      "available; lower --sequences (or --tokens).")
    if device == "cuda":  # the sampler keeps its log μ on the GPU until it returns
        free, _ = torch.cuda.mem_get_info()
        on_gpu = 4 * vocab * sequences * tokens + 4 * vocab * min(sequences, micro_batch) * tokens
        if on_gpu > free:
            raise _refuse(f"the full-vocabulary log-probabilities of {sequences} sequences × {tokens} tokens need "
                          f"about {on_gpu / 1e9:.1f} GB on the GPU and {free / 1e9:.1f} GB is free; lower "
                          "--sequences (or --tokens).")
    return need


def resolve_model(name: str, profile=None) -> tuple[str | None, str, str, object]:
    """(model_id for models.load, lab kind, the checkpoint's path, profile) for `--model`; lab:KIND builds the toy."""
    from . import models, profiles

    if name.startswith("lab:"):
        kind = name.removeprefix("lab:")
        if kind not in models.KINDS:
            raise _refuse(f"--model {name}: the lab's toy models are {', '.join('lab:' + k for k in models.KINDS)}.")
        profile = profile or profiles.resolve("auto")
        return None, kind, str(models.lab_model_dir(kind, profile)), profile
    try:
        return name, "dense", models.resolve_model(name, "dense", None), profile
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as err:
        raise _refuse(f"--model {name}: {err}") from None


def build_prompts(tokenizer, count: int, seed: int) -> tuple[list[list[int]], str]:
    """The model's chat requests for a long answer, or the toy task's prompts where it has no chat template."""
    from . import pretrained, task

    if getattr(tokenizer, "chat_template", None):
        return pretrained.chat_prompts(tokenizer, count), "chat requests for a long answer"
    problems = task.sample_problems(random.Random(seed), count, 12, 20)
    return [tokenizer(q.prompt, add_special_tokens=False)["input_ids"] for q in problems], "the toy task's prompts"


def check_context(config, prompts: list[list[int]], tokens: int) -> None:
    """Stop in one sentence where the longest prompt plus `tokens` is past the model's context."""
    context = getattr(config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompts)
    if context and longest + tokens > context:
        raise _refuse(f"--tokens {tokens} after a prompt of {longest} tokens is past the model's context of "
                      f"{context} tokens; ask for at most --tokens {context - longest}.")


def sample_with_progress(engine, prompts: list[list[int]], tokens: int, temperature: float, seed: int):
    """The sampler's rollout of `tokens` tokens per prompt (EOS banned), full-vocabulary log μ kept, with a bar."""
    from tqdm import tqdm

    generator = torch.Generator(engine.device).manual_seed(seed)
    with tqdm(total=tokens, desc=f"sampling {len(prompts)} sequences", unit="token") as bar:

        def tick(*_) -> None:  # a forward hook that returned a value would replace the model's output
            bar.update(1)

        if isinstance(engine, llamacpp.Engine):  # llama.cpp calls back once per decoded position
            engine.on_step = tick
            hook = None
        else:
            hook = engine.model.register_forward_hook(tick)  # one forward per token position
        try:
            return engine.sample(prompts, tokens, tokens, temperature=temperature, keep_vocab=True,
                                 generator=generator)
        finally:
            if hook is not None:
                hook.remove()


def _band(value: float, stderr: float, sequences: int) -> dict:
    """A mean, its standard error over sequences and its t interval, as the report keeps them."""
    low, high = clusters.interval(value, stderr, sequences)
    return {"value": value, "stderr": stderr, "low": low, "high": high, "sequences": sequences}


def analyse(log_mu: torch.Tensor, log_pi: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor) -> dict:
    """Every quantity of the report from the sampled tokens' log μ and log π, their mask and the exact token KL."""
    sequences, tokens = mask.shape
    log_ratio = (log_pi - log_mu).double() * mask
    k3_values = torch.expm1(log_ratio) - log_ratio
    found = {"token_kl": _band(*clusters.mean(kl, mask), sequences),
             "k3": _band(*clusters.mean(k3_values, mask), sequences)}
    quarter = tokens // 4
    found["kl_by_band"] = clusters.by_position(kl, mask, [0, quarter, 2 * quarter, 3 * quarter, tokens])
    found["kl_by_mu_bucket"] = clusters.by_bucket(kl, log_mu.exp(), mask, MU_EDGES)
    block = min(128, quarter)  # chapter 4b's fit: prefixes every block/4 tokens, over runs of 2·block
    slope, slope_se = clusters.prefix_slope(log_ratio, block // 4, 2 * block)
    found["drift_per_1k"] = {**_band(slope, slope_se, sequences), "step": block // 4, "window": 2 * block,
                             "expected": -1000 * found["token_kl"]["value"]}
    prefix = log_ratio.cumsum(-1)
    lengths = sorted({n for n in SD_LENGTHS if n <= tokens} | {tokens})
    found["prefix_sd"] = {}
    for n in lengths:
        sd = float(prefix[:, n - 1].std())
        low, high = clusters.sd_interval(sd, sequences)
        found["prefix_sd"][n] = {"measured": sd, "low": low, "high": high,
                                 "independent_tokens": math.sqrt(max(0.0, 2 * found["token_kl"]["value"] * n))}
    health = grpo.importance_health(log_ratio, mask)  # each sequence's weight π(y)/μ(y), as the RL runs log it
    found["sequence_weights"] = {"mean": health["seq_weight_mean"], "ess_share": health["ess"],
                                 "chi2": health["seq_chi2"], "log_weight_mean": float(prefix[:, -1].mean()),
                                 "log_weight_sd": float(prefix[:, -1].std())}
    settings = framework_metrics.trl_defaults()
    found["trl_modes"] = {"defaults": dict(settings), "lengths": lengths,
                          **{mode: sampling_correction.by_length(log_ratio, tuple(lengths), mode, settings["clip_min"],
                                                                 settings["clip_max"])
                             for mode in sampling_correction.MODES}}
    found["frameworks"] = framework_metrics.measure(log_pi, log_mu, mask)
    found["framework_sources"] = dict(framework_metrics.SOURCES)
    return found


def verdicts(found: dict, sampler: str, trainer: str, mode: str, book_model: bool, temperature: float) -> dict:
    """Per headline quantity: the book's measurements of the same set-up and the one-line verdict against them."""
    from . import pretrained

    why = ("" if book_model and temperature == 1.0 else
           f"the book measured {pretrained.NAME} only; no range for another model" if not book_model else
           f"the book measured at temperature 1 only; no range at temperature {temperature:g}")
    default_mode = found["trl_modes"]["defaults"]["mode"]
    rows = {"token_kl": (found["token_kl"]["value"], found["token_kl"]["low"], found["token_kl"]["high"]),
            "k3": (found["k3"]["value"], found["k3"]["low"], found["k3"]["high"]),
            "drift_per_1k": (found["drift_per_1k"]["value"], found["drift_per_1k"]["low"],
                             found["drift_per_1k"]["high"])}
    for n, sd in found["prefix_sd"].items():
        rows[f"prefix_sd.{n}"] = (sd["measured"], sd["low"], sd["high"])
    for n, weight in found["trl_modes"][default_mode].items():
        low, high = clusters.interval(weight["mean"], weight["se"], found["token_kl"]["sequences"])
        rows[f"trl_default_weight.{default_mode}.{n}"] = (weight["mean"], low, high)
    out = {}
    for quantity, (value, low, high) in rows.items():
        refs = (book_measurements.references(quantity, sampler, trainer, mode, found["kl_by_band"][-1]["to"])
                if not why else [])
        out[quantity] = {"line": book_measurements.verdict(value, low, high, refs, why),
                         "references": [asdict(r) for r in refs]}
    return out


def figure(found: dict, log_ratio: torch.Tensor, colour_of: str, path: Path) -> Path:
    """The prefix log-ratio of every sequence beside −KL·n, and the exact KL by position band (± 2 s.e.)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import plots

    plots.style()
    colour = plots.colour(colour_of)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    prefix = log_ratio.double().cumsum(-1)
    positions = torch.arange(1, prefix.shape[1] + 1)
    for i, row in enumerate(prefix):
        left.plot(positions, row, color=colour, lw=0.8, alpha=0.6, label="one sequence each" if i == 0 else None)
    left.plot(positions, -found["token_kl"]["value"] * positions, color="black", ls="--", lw=1,
              label="−(exact token KL) × n")
    left.set(xlabel="prefix length n (tokens)", ylabel="log π(y≤n) − log μ(y≤n) (nats)",
             title="Sequence log-weight, per sequence")
    left.legend(fontsize=8)
    bands = [b for b in found["kl_by_band"] if math.isfinite(b["mean"])]
    centres = [(b["from"] + b["to"]) / 2 for b in bands]
    # the same 95% t intervals (over sequences) as the printed report
    errors = [b["mean"] - clusters.interval(b["mean"], b["stderr"], found["token_kl"]["sequences"])[0]
              if math.isfinite(b["stderr"]) else 0.0 for b in bands]
    right.errorbar(centres, [b["mean"] for b in bands], yerr=errors, fmt="o", color=colour, capsize=3)
    right.axhline(found["token_kl"]["value"], color="black", ls=":", lw=1, label="over all tokens")
    right.set(xlabel="position in the completion (tokens, band centre)", ylabel="exact token KL[μ‖π] (nats)",
              title="Token KL by position band, 95% t intervals")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _plain(value):
    """JSON-safe: tensors and numbers to floats, NaN and infinities to null, keys to strings."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def run(args: argparse.Namespace, profile=None) -> dict:
    """Check the request, measure the mismatch, draw the figure, and return the whole report."""
    from transformers import AutoConfig, AutoTokenizer

    from . import env, mismatch, models, pretrained

    began = time.perf_counter()
    request = check_request(args)
    model_id, kind, path, profile = resolve_model(args.model, profile)
    try:
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise _refuse(f"--model {args.model}: its config or tokenizer could not be read ({type(err).__name__}); "
                      "check the name, and the network for a hub id.") from None
    need = check_memory(args.sequences, args.tokens, config.vocab_size, request["device"], args.micro_batch)
    prompts, prompt_kind = build_prompts(tokenizer, args.sequences, args.seed)
    check_context(config, prompts, args.tokens)

    model, tokenizer = models.load(model_id, kind, profile, device=request["device"])
    loaded = time.perf_counter()
    sampler, trainer = build_engines(args, request, model)
    nucleus = (serving_options.Nucleus(sampler, args.top_p, args.temperature) if args.top_p < 1 else None)
    out = sample_with_progress(sampler, prompts, args.tokens, args.temperature, args.seed)
    if nucleus is not None:
        nucleus.remove()
    if request["engine"] == "llama.cpp":
        sampler.close()
    del sampler
    if args.logprobs == "raw":  # what a server returns before its temperature: the trainer's μ is then wrong
        out.vocab_logprobs = serving_options.raw_logprobs(out.vocab_logprobs, args.temperature)
        out.logprobs = out.vocab_logprobs.gather(-1, out.completion_ids[..., None]).squeeze(-1) * out.mask
    sampled = time.perf_counter()
    device_type = torch.device(request["device"]).type
    scope = (torch.autocast(device_type, dtype=request["trainer_dtype"]) if request["autocast"]
             else contextlib.nullcontext())
    with scope:
        scored = trainer.score(out, args.temperature, keep_vocab=True)
    del trainer
    headroom = activation_headroom(model, out, args.micro_batch, request["device"])
    mask = out.mask.float()
    kl = mismatch.token_kl(out.vocab_logprobs, scored.vocab) * mask
    log_mu, log_pi = out.logprobs, scored.logprobs
    del out, scored
    scored_at = time.perf_counter()

    found = analyse(log_mu, log_pi, mask, kl)
    found["activations"] = headroom
    found["per_sequence_kl"] = ((kl * mask).sum(-1) / mask.sum(-1)).tolist()  # for comparisons paired by prompt
    if nucleus is not None:  # where the engines otherwise agree, KL[μ‖π] = −log(kept mass) per token
        lost = -nucleus.kept_mass()[:, : mask.shape[1]].double().log() * mask
        found["top_p"] = {"p": args.top_p, "closed_form": _band(*clusters.mean(lost, mask), args.sequences),
                          "kept_mass": float((nucleus.kept_mass()[:, : mask.shape[1]] * mask).sum() / mask.sum())}
    book_model = args.model == pretrained.NAME
    found["verdicts"] = verdicts(found, request["book_sampler"], request["trainer"], args.trainer_mode, book_model,
                                 args.temperature)
    report = env.env_report()
    name = pretrained.DESCRIPTION if book_model else (f"the lab's toy {kind} model" if model_id is None else model_id)
    found["setup"] = {
        "model": name, "model_arg": args.model, "parameters": sum(w.numel() for w in model.parameters()),
        "vocab_size": config.vocab_size, "layers": getattr(config, "num_hidden_layers", None),
        "sampler": args.sampler, "sampler_label": request["label"], "trainer": args.trainer,
        "trainer_mode": args.trainer_mode, "trainer_label": trainer_label(request["trainer"], args.trainer_mode),
        "temperature": args.temperature, "sequences": args.sequences, "tokens": args.tokens, "seed": args.seed,
        "prompts": prompt_kind, "device": request["device"], "top_p": args.top_p, "logprobs": args.logprobs,
        "fp32_head": args.fp32_head, "flash_attention": args.flash_attention, "lora": args.lora, "lora_rank": args.lora_rank, "micro_batch": args.micro_batch,
        "device_name": report["device_name"] if request["device"] == "cuda" else report.get("cpu"),
        "full_vocab_bytes": need, "env": report}
    found["seconds"] = {"load": loaded - began, "sample": sampled - loaded, "score": scored_at - sampled}
    path = args.figure or args.json.with_suffix(".png")
    found["figure"] = str(figure(found, (log_pi - log_mu).double() * mask, colour_name(request), path))
    return found


def colour_name(request: dict) -> str:
    """The format whose colour the figure draws the sampler in (grey for emulated and block formats)."""
    dial = request["dial"]
    if dial is None:
        return {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}.get(request["sampler"], "emulated")
    names = {"real": str(rollout.DTYPES.get(dial.name)).removeprefix("torch."), "fp8": "float8_e4m3fn"}
    return names.get(dial.kind, "emulated")


def activation_headroom(model, out, rows: int, device: str) -> dict:
    """The largest |activation| per decoder layer (residual stream, MLP hidden, attention scores q·k) of the fp32
    model on the first `rows` sampled sequences, and fp16's headroom over it (chapter 8's probe)."""
    from . import overflow

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not all(hasattr(getattr(layer, "mlp", None), "down_proj") for layer in layers):
        return {"measured": False, "why": "this architecture has no per-layer MLP down_proj to watch"}
    previous = model.config._attn_implementation
    model.set_attn_implementation(overflow.register_probe())  # eager attention that also records q·k
    try:
        ids, _, _ = rollout.pack(out, torch.arange(min(rows, len(out.prompt_ids))), rollout.special_ids(model.config)[0])
        with torch.no_grad(), overflow.Maxima(model) as maxima:
            model(**rollout.packed_inputs(ids, device))
    finally:
        model.set_attn_implementation(previous)
    found = {"measured": True, "fp16_max": overflow.FP16_MAX, "sequences": min(rows, len(out.prompt_ids))}
    for place in overflow.PLACES:
        per_layer = maxima.max[place]
        largest = max(per_layer)
        found[place] = {"max": largest, "layer": per_layer.index(largest), "headroom": overflow.headroom(largest),
                        "per_layer": per_layer}
    return found


def build_engines(args: argparse.Namespace, request: dict, model):
    """The sampler and the trainer the request names, with its LoRA adapter and fp32 heads where asked."""
    trainer_dtype = torch.float32 if request["autocast"] else request["trainer_dtype"]
    if request["engine"] == "llama.cpp":
        sampler = llamacpp.Engine(request["sampler"], flash_attention=args.flash_attention)
    elif args.lora > 0:
        sampler, trainer = serving_options.lora_pair(model, args.lora, args.lora_rank, request["sampler"],
                                                     trainer_dtype, request["device"], args.micro_batch, args.seed)
    else:
        sampler = sampler_precision.engine(model, request["sampler"], request["device"])
    if args.lora == 0:
        trainer = rollout.TrainingEngine(model, trainer_dtype, request["device"], micro_batch=args.micro_batch)
    if args.fp32_head in ("sampler", "both"):
        serving_options.fp32_head(sampler, model)
    if args.fp32_head in ("trainer", "both"):
        serving_options.fp32_head(trainer, model)
    return sampler, trainer


def trainer_label(dtype: str, mode: str) -> str:
    """How the trainer computes, in words."""
    if dtype == "fp32":
        return "fp32 weights and arithmetic; autocast and pure agree"
    if mode == "autocast":
        return f"fp32 weights under torch.autocast to {dtype}"
    return f"weights cast whole to {dtype}"


def _num(value: float, stderr: float | None = None) -> str:
    """A value to three digits, ± its standard error where it has one."""
    text = f"{value:.3g}" if math.isfinite(value) else "—"
    return text if stderr is None or not math.isfinite(stderr) else f"{text} ± {stderr:.2g}"


def options(setup: dict) -> str:
    """The stack options that differ from the defaults, in words."""
    said = [f"top-p {setup['top_p']:g}" if setup.get("top_p", 1) < 1 else "",
            "raw log μ (before temperature)" if setup.get("logprobs") == "raw" else "",
            f"fp32 LM head on the {setup['fp32_head']} side" if setup.get("fp32_head", "none") != "none" else "",
            f"LoRA rank {setup['lora_rank']} of relative size {setup['lora']:g}, merged in the sampler"
            if setup.get("lora") else "",
            f"trainer micro-batch {setup['micro_batch']}" if setup.get("micro_batch", MICRO_BATCH) != MICRO_BATCH else "",
            "llama.cpp's flash attention off" if setup.get("flash_attention") == "off" else ""]
    return "; ".join(x for x in said if x).replace("on the both side", "on both sides")


def render(found: dict) -> str:
    """The report as a short text for a terminal."""
    s = found["setup"]
    kl, k3, drift = found["token_kl"], found["k3"], found["drift_per_1k"]
    lines = [f"mismatch doctor: {s['model']}, {s['parameters'] / 1e6:.1f}M parameters, vocabulary {s['vocab_size']:,}",
             f"sampler {s['sampler']} ({s['sampler_label']}); trainer {s['trainer']} ({s['trainer_label']})",
             f"{s['sequences']} sequences of {s['tokens']} tokens (EOS banned) from {s['prompts']}, temperature "
             f"{s['temperature']:g}, seed {s['seed']}; {s['device']} ({s['device_name']})",
             *([f"options: {options(s)}"] if options(s) else []),
             f"loaded in {found['seconds']['load']:.0f} s, sampled in {found['seconds']['sample']:.0f} s, "
             f"scored in {found['seconds']['score']:.0f} s; ± is one standard error over sequences", "",
             f"token KL[μ‖π], exact      {_num(kl['value'], kl['stderr'])} nats  "
             f"(95%: {kl['low']:.3g} – {kl['high']:.3g})",
             f"k3, sampled tokens only   {_num(k3['value'], k3['stderr'])} nats",
             "KL by position band       " + ";  ".join(f"{b['from']}–{b['to']}: {_num(b['mean'], b['stderr'])}"
                                                      for b in found["kl_by_band"]),
             "KL by μ of the sampled token " + ";  ".join(
                 f"[{b['from']:g}, {b['to']:g}): {_num(b['mean'], b['stderr'])} ({b['count']} tokens)"
                 for b in found["kl_by_mu_bucket"] if b["count"]),
             f"log-weight drift          {_num(drift['value'], drift['stderr'])} nats per 1K tokens "
             f"(expected, −1000 × token KL: {drift['expected']:.3g}; "
             + ("within the drift's 95% interval: no trend beyond the token KL)"
                if drift["low"] <= drift["expected"] <= drift["high"]
                else "outside the drift's 95% interval: a trend the token KL does not explain)"),
             "prefix log-ratio SD       " + ";  ".join(
                 f"at {n}: {v['measured']:.3g} (95%: {v['low']:.2g} – {v['high']:.2g}; independent tokens "
                 f"{v['independent_tokens']:.2g})" for n, v in found["prefix_sd"].items())]
    if "top_p" in found:
        t = found["top_p"]
        lines.append(f"top-p {t['p']:g} keeps {t['kept_mass']:.3f} of π's mass per token on average; its closed "
                     f"form −log(kept) is {_num(t['closed_form']['value'], t['closed_form']['stderr'])} nats per token")
    a = found.get("activations", {})
    if a.get("measured"):
        where = ";  ".join(f"{place.replace('_', ' ')} {a[place]['max']:.3g} (layer {a[place]['layer']})"
                           for place in ("residual", "mlp_hidden", "attention_scores"))
        least = min(a[place]["headroom"] for place in ("residual", "mlp_hidden", "attention_scores"))
        lines.append(f"largest activation (fp32, {a['sequences']} sequences): {where}; fp16's largest value "
                     f"{a['fp16_max']:,.0f} is {least:.3g}× the largest"
                     + (": an fp16 switch does not overflow on these inputs" if least > 1 else
                        ": these activations overflow fp16"))
    elif a:
        lines.append(f"largest activation: not measured ({a['why']})")
    w = found["sequence_weights"]
    lines.append(f"sequence weights π(y)/μ(y) ESS share {w['ess_share']:.3f} of {s['sequences']} sequences, "
                 f"χ² {w['chi2']:.3g}, mean {w['mean']:.3g}")
    trl = found["trl_modes"]
    d = trl["defaults"]
    last = trl["lengths"][-1]
    lines += ["", f"trl's vllm_importance_sampling_mode on these samples (clip_min {d['clip_min']}, clip_max "
                  f"{d['clip_max']}): mean weight of a completion at {last} tokens, share cut"]
    for mode in sampling_correction.MODES:
        r = trl[mode][last]
        unit = "completions" if mode.startswith("sequence") else "tokens"
        lines.append(f"  {mode:<18}{' (default)' if mode == d['mode'] else '          '} {_num(r['mean'], r['se'])}, "
                     f"{100 * r['cut_share']:.0f}% of {unit} {'masked' if mode.endswith('mask') else 'clipped'}")
    shown = {"trl": list(found["frameworks"]["trl"]),
             "verl": ["rollout_corr/k3_kl", "rollout_corr/kl", "rollout_corr/chi2_token", "rollout_corr/chi2_seq",
                      "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_is_ratio_fraction_high"],
             "NeMo-RL": list(found["frameworks"]["NeMo-RL"])}
    lines += ["", "what each framework would log for this batch, at its defaults (all of them in the JSON):"]
    for framework, names in shown.items():
        lines.append(f"  {framework}: " + ", ".join(f"{n} {found['frameworks'][framework][n]:.4g}" for n in names))
    names = {"token_kl": "token KL", "k3": "k3", "drift_per_1k": "drift per 1K"}
    here = book_measurements.device(s["env"].get("cpu", "?"), s["env"].get("kernels", "?"))
    lines += ["", "against the book's own measurements of its real model at temperature 1 (95% intervals):"]
    for quantity, v in found["verdicts"].items():
        label = names.get(quantity) or (f"prefix SD at {quantity.split('.')[1]}" if quantity.startswith("prefix_sd")
                                        else f"trl default weight at {quantity.split('.')[2]}")
        lines.append(f"  {label}: {v['line']}")
        for r in v["references"]:
            on = ("the same CPU and kernel set as this run" if r["device"] == here and s["device"] == "cpu"
                  else r["device"])
            lines.append(f"      from {r['where']}; on {on}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, profile=None) -> dict:
    """Run the doctor from the command line: print the report, write the JSON and the figure."""
    import logging

    # bitsandbytes (imported with transformers) logs that its optional CPU kernel is not installed
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    args = _parser().parse_args(argv)
    found = run(args, profile)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(_plain(found), indent=1) + "\n")
    print(render(found))
    print(f"\nwrote {args.json} and {found['figure']}")
    return found


if __name__ == "__main__":
    main()
