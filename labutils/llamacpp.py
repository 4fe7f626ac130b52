"""llama.cpp as the lab's second inference engine: another program, not the same code in another dtype.

`write(kind)` writes the real model as a GGUF file of one llama.cpp type from the same fp32 weights the
torch engines load (the shipped Q4_1 file dequantized by the `gguf` package, as transformers dequantizes it).
`Engine(kind)` samples with llama.cpp's own kernels, many sequences in one batched decode as a server runs
them, draws each token with the book's sampler from llama.cpp's logits, and returns the book's `Rollout`,
so `rollout.TrainingEngine` rescores llama.cpp's samples exactly as it rescores the torch engines'.

What llama.cpp rounds is not what torch's pure-dtype engines round (`PRECISION` and `ATTENTION`, read from
llama.cpp's source at the version `make setup` builds): a weight product rounds its activations to the
weights' type and sums in F32; norms, RoPE and the residual stream stay F32; attention depends on flash
attention, which llama.cpp turns on by default ("auto") wherever the CPU runs it, and which computes in F16.
"""
from __future__ import annotations

import ctypes
import importlib.util
import time
from pathlib import Path

import numpy as np
import torch

from . import pretrained, rollout

VERSION = "0.3.36"  # llama-cpp-python, as `make setup` builds it; the sources quoted below are its vendored llama.cpp
KINDS = ("f32", "f16", "bf16", "q8_0", "q4_0")
# where llama.cpp rounds, per type (vendor/llama.cpp at VERSION): ggml-cpu.c's type_traits_cpu gives each weight
# type the type its activations are converted to before a product (`vec_dot_type`), summed in F32;
# llama_context_default_params (src/llama-context.cpp) caches K and V in F16 and sets flash attention to auto
PRECISION = {
    "f32": "weights F32; activations F32 into every weight product; KV cache F32 (set here)",
    "f16": "weights F16; activations rounded to F16 at every weight product, summed in F32; KV cache F16",
    "bf16": "weights BF16; activations rounded to BF16 at every weight product, summed in F32; KV cache F16",
    "q8_0": "weights Q8_0 (8-bit, one F16 scale per 32); activations quantized to Q8_0 per 32; KV cache F16",
    "q4_0": "decoder weights Q4_0 (4-bit, one F16 scale per 32), embedding and head Q8_0 as shipped; "
            "activations quantized to Q8_0 per 32; KV cache F16",
}
# flash attention casts K and V to F16 even from an F32 cache (src/llama-graph.cpp, build_attn_mha), converts Q
# to F16, and when one token is decoded per sequence sums softmax·V in an F16 buffer (ggml-cpu/ops.cpp,
# ggml_compute_forward_flash_attn_ext_f16_one_chunk, VKQ16); without it both attention products are ordinary
# products with the cache's type as their weights (Q and the softmax weights rounded to it, summed in F32)
ATTENTION = {
    "auto": "flash attention (llama.cpp's default where the CPU runs it): Q, K and V in F16, softmax·V summed "
            "in F16 at each decoded token",
    "off": "flash attention off: Q·K and softmax·V as products against the KV cache's type, summed in F32",
}
FLASH_ATTENTION = {"auto": -1, "off": 0}  # llama_flash_attn_type: LLAMA_FLASH_ATTN_TYPE_AUTO, _DISABLED
SOURCES = {"vec_dot_type": "vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c, type_traits_cpu",
           "kv_cache_f16": "vendor/llama.cpp/src/llama-context.cpp, llama_context_default_params (type_k, type_v, "
                           "flash_attn_type)",
           "flash_attention_f16": "vendor/llama.cpp/src/llama-graph.cpp, build_attn_mha (ggml_cast to F16)",
           "flash_attention_sum": "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp, "
                                  "ggml_compute_forward_flash_attn_ext_f16_one_chunk (VKQ16)"}
BUILD_MINUTES = "3–12"  # the first build: 3 on 2 free cores, 12 on one busy core (measured); pip caches the wheel


def require():
    """The `llama_cpp` binding, or one sentence on how to install it."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise ModuleNotFoundError(f"llama.cpp's Python binding (llama-cpp-python {VERSION}) is not installed; run "
                                  f"`make setup`, which builds it from source once ({BUILD_MINUTES} minutes) and "
                                  "lets pip cache the wheel.")
    import llama_cpp

    return llama_cpp


def check_kind(kind: str) -> str:
    """`kind` if llama.cpp runs it here; one sentence naming the ones it does where not."""
    if kind not in KINDS:
        raise ValueError(f"llama.cpp type {kind!r} is not one the lab writes; choose one of {', '.join(KINDS)}.")
    return kind


def check_model(model_id: str | None) -> None:
    """Stop in one sentence where the lab has no GGUF of `model_id` to give llama.cpp."""
    if model_id != pretrained.NAME:
        raise ValueError(f"llama.cpp reads GGUF files and the lab writes them only for {pretrained.NAME} (from the "
                         f"GGUF it ships as), not for {model_id or 'the toy models'}; convert another model with "
                         "llama.cpp's convert_hf_to_gguf.py and compare it with the torch engines yourself.")


def _quant_type(kind: str, name: str, values: np.ndarray):
    """The GGUF type a tensor is written in: 1-D tensors (norms) stay F32, as llama.cpp's converter keeps them."""
    from gguf import GGMLQuantizationType as Q

    if values.ndim == 1 or kind == "f32":
        return Q.F32
    if kind == "q4_0" and name == "token_embd.weight":  # the tied embedding and head stay 8-bit, as shipped
        return Q.Q8_0
    return {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[kind]


def write(kind: str, root: Path | None = None) -> Path:
    """The real model as a GGUF file of llama.cpp type `kind`, written once into the lab cache."""
    import gguf

    from . import models

    check_kind(kind)
    source = pretrained.gguf_path()
    root = root or models.pretrained_root()
    target = root / f"{pretrained.NAME}-{pretrained._fingerprint(source)}-{kind}.gguf"
    if target.is_file():
        return target
    reader = gguf.GGUFReader(source)
    partial = target.with_suffix(".partial")
    root.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(partial, arch=reader.fields["general.architecture"].contents())
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                  "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    for field in reader.fields.values():  # the tokenizer, chat template and shapes, unchanged
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        kind_of = field.types[0]
        sub = field.types[-1] if kind_of == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind_of, sub_type=sub)
    writer.add_file_type(file_types[kind])
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        qtype = _quant_type(kind, tensor.name, values)
        data = {gguf.GGMLQuantizationType.F32: values,
                gguf.GGMLQuantizationType.F16: values.astype(np.float16)}.get(qtype)
        if data is None:
            data = gguf.quants.quantize(values, qtype)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target


_SILENT = None  # llama.cpp's log callback, kept alive while the library may call it


def _silence(llama_cpp) -> None:
    """llama.cpp prints every load and decode detail to stderr: keep them out of the chapters."""
    global _SILENT
    if _SILENT is None:
        _SILENT = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_SILENT, ctypes.c_void_p(0))


class Engine:
    """A llama.cpp context over one GGUF type of the real model, sampling like `rollout.InferenceEngine`.

    All rows decode together, one token each per step (one sequence id per row, as a server batches them);
    each step's logits come back as F32, and the book's sampler (`rollout.sample_step`: EOS ban, temperature,
    Gumbel-max draws per row and step from `generator`) draws from them, so a torch engine and this one given
    the same seed share their draws and write the same tokens until their distributions move an argmax.
    """

    def __init__(self, kind: str, threads: int | None = None, path: Path | None = None,
                 flash_attention: str = "auto"):
        self.llama = require()
        self.kind = check_kind(kind)
        if flash_attention not in FLASH_ATTENTION:
            raise ValueError(f"flash_attention={flash_attention!r}: choose 'auto' (llama.cpp's default) or 'off'.")
        self.flash_attention = flash_attention
        self.path = path or write(kind)
        self.threads = threads or torch.get_num_threads()
        self.device = "cpu"
        self.on_step = None  # called once per decoded token position (a progress bar)
        _silence(self.llama)
        self.llama.llama_backend_init()
        params = self.llama.llama_model_default_params()
        self._model = self.llama.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {self.path}; delete it to have the lab write it again.")
        vocab = self.llama.llama_model_get_vocab(self._model)
        self.vocab_size = self.llama.llama_vocab_n_tokens(vocab)
        self.eos_id = self.llama.llama_vocab_eos(vocab)
        self._ctx, self._capacity = None, (0, 0)

    def _context(self, rows: int, per_row: int):
        """A context with room for `rows` sequences of `per_row` tokens each (made again only when it must grow)."""
        if self._ctx is not None and rows <= self._capacity[0] and per_row <= self._capacity[1]:
            self.llama.llama_memory_clear(self.llama.llama_get_memory(self._ctx), True)
            return self._ctx
        self.close_context()
        per_row = -(-per_row // 256) * 256
        params = self.llama.llama_context_default_params()
        params.n_ctx, params.n_seq_max = rows * per_row, rows
        params.n_batch = params.n_ubatch = max(512, rows)
        params.n_threads = params.n_threads_batch = self.threads
        params.flash_attn_type = FLASH_ATTENTION[self.flash_attention]
        if self.kind == "f32":
            params.type_k = params.type_v = self.llama.GGML_TYPE_F32
        self._ctx = self.llama.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {rows} sequences of {per_row} tokens; "
                               "ask for fewer sequences or tokens.")
        self._capacity = (rows, per_row)
        return self._ctx

    def _decode(self, ctx, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode (token, position, sequence, wants logits) entries in batches of n_batch; the batch index of
        each entry that wants logits."""
        llama, size = self.llama, max(512, self._capacity[0])
        wanted = []
        for start in range(0, len(entries), size):
            chunk = entries[start:start + size]
            batch = llama.llama_batch_init(len(chunk), 0, 1)
            try:
                batch.n_tokens = len(chunk)
                for i, (token, pos, seq, logits) in enumerate(chunk):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                    batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
                if llama.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama.cpp's decode failed; the context is too small for this request.")
            finally:
                llama.llama_batch_free(batch)
            wanted = [i for i, e in enumerate(chunk) if e[3]]  # logits are read after the chunk that made them
        return wanted

    def _logits(self, ctx, indices: list[int]) -> torch.Tensor:
        """The F32 logits llama.cpp returned for the given batch indices, as one [rows, vocab] tensor."""
        out = np.empty((len(indices), self.vocab_size), dtype=np.float32)
        for row, i in enumerate(indices):
            out[row] = np.ctypeslib.as_array(self.llama.llama_get_logits_ith(ctx, i), shape=(self.vocab_size,))
        return torch.from_numpy(out)

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], max_new_tokens, min_new_tokens=0, temperature: float = 1.0,
               generator: torch.Generator | None = None, keep_vocab: bool | int = False) -> rollout.Rollout:
        """One completion per prompt, with log μ of each token (and of the whole vocabulary where kept)."""
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be positive; sampling needs a distribution.")
        batch = len(prompt_ids)
        budget = rollout._per_row(max_new_tokens, batch, "max_new_tokens")
        floor = rollout._per_row(min_new_tokens, batch, "min_new_tokens")
        if bool((floor > budget).any()) or int(budget.min()) < 1:
            raise ValueError("every row needs 1 <= min_new_tokens <= max_new_tokens.")
        steps = int(budget.max())
        ctx = self._context(batch, max(len(p) for p in prompt_ids) + steps)
        start = time.perf_counter()  # after the context's allocation, as the torch engine's clock starts
        kept = batch if keep_vocab is True else min(batch, int(keep_vocab))
        completion = torch.full((batch, steps), self.eos_id, dtype=torch.long)
        alive = torch.zeros((batch, steps), dtype=torch.bool)
        logps = torch.zeros((batch, steps))
        vocab = torch.zeros((kept, steps, self.vocab_size)) if kept else None
        rows = torch.arange(batch)
        logits = self._prefill(ctx, prompt_ids)
        for step in range(steps):
            token, going = rollout.sample_step(logits, step, rows, floor, budget, temperature, generator, self.eos_id,
                                               completion, alive, logps, vocab)
            if self.on_step is not None:
                self.on_step()
            if not bool(going.any()):
                break
            rows, token = rows[going], token[going]
            entries = [(int(t), len(prompt_ids[r]) + step, int(r), True) for r, t in zip(rows, token)]
            logits = self._logits(ctx, self._decode(ctx, entries))
        used = int(alive.any(0).sum())
        return rollout.Rollout(prompt_ids=[list(p) for p in prompt_ids], completion_ids=completion[:, :used],
                               mask=alive[:, :used], logprobs=logps[:, :used],
                               vocab_logprobs=vocab[:, :used] if kept else None, min_new_tokens=floor,
                               seconds=time.perf_counter() - start)

    def _prefill(self, ctx, prompt_ids: list[list[int]]) -> torch.Tensor:
        """Every prompt through the model (a row's prompt per decode where they do not fit one batch together);
        the logits of each row's last prompt token."""
        entries = [[(tok, pos, row, pos == len(p) - 1) for pos, tok in enumerate(p)] for row, p in enumerate(prompt_ids)]
        flat = [e for row in entries for e in row]
        if len(flat) <= max(512, self._capacity[0]):
            return self._logits(ctx, self._decode(ctx, flat))
        return torch.cat([self._logits(ctx, self._decode(ctx, row)) for row in entries])

    def close_context(self) -> None:
        if self._ctx is not None:
            self.llama.llama_free(self._ctx)
            self._ctx, self._capacity = None, (0, 0)

    def close(self) -> None:
        """Free llama.cpp's context and model."""
        self.close_context()
        if getattr(self, "_model", None):
            self.llama.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass
