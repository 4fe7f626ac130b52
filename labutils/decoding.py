"""The sampler's decode step as a serving engine runs it: a KV cache written in place, and one-query attention
with the numerics of a fused kernel.

transformers' default cache concatenates every layer's whole cache at every token, and PyTorch's fused CPU
attention is tuned for long queries: at one query against 512 keys it is ten times slower than two plain
matrix products. Both are swapped through transformers' public hooks (a `Cache` of our own layers, and a
registered attention function); the prompt's forward keeps the fused kernel.

The numerics are FlashAttention's, PyTorch's CPU kernel's included: scores of the cached 16-bit keys
accumulated in fp32; their exponentials, before normalisation, rounded to the engine's dtype for the
product with the values, accumulated in fp32; the sum of the fp32 exponentials divides at the end. Only
the order of the additions differs from the trainer's whole-sequence kernel.
"""
from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "lab_decode"  # the name the engines' models run their attention under


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if query.shape[2] != 1:  # the prompt: every position at once, through the fused kernel
        return sdpa_attention_forward(module, query, key.to(query.dtype), value.to(query.dtype), attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    batch, heads, _, width = query.shape
    groups = key.shape[1]  # grouped-query attention: each key/value head serves heads // groups queries
    scale = scaling if scaling is not None else 1 / math.sqrt(width)
    scores = query.reshape(batch, groups, heads // groups, width).float() @ key.float().transpose(-1, -2) * scale
    if attention_mask is not None:  # sdpa's mask: [batch, 1, 1, keys], True where a key may be seen
        mask = attention_mask.reshape(batch, 1, 1, -1)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    exps = (scores - scores.amax(-1, keepdim=True)).exp()
    out = exps.to(query.dtype).float() @ value.float() / exps.sum(-1, keepdim=True)
    return out.reshape(batch, heads, 1, width).transpose(1, 2).to(query.dtype), None


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class _GrowingLayer(DynamicLayer):
    """One layer's keys and values in a buffer that doubles when full: a token costs one write, not a copy of
    the cache. Stored in fp32, exact copies of the engine's 16-bit values, so attention never upcasts them."""

    is_croppable = False

    def lazy_initialization(self, key_states, value_states):
        self.device, self.length = key_states.device, 0
        self._keys = key_states.new_zeros((*key_states.shape[:2], 0, key_states.shape[-1]), dtype=torch.float32)
        self._values = value_states.new_zeros((*value_states.shape[:2], 0, value_states.shape[-1]),
                                              dtype=torch.float32)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, stop = self.length, self.length + key_states.shape[-2]
        if stop > self._keys.shape[-2]:
            capacity = max(2 * self._keys.shape[-2], stop, 64)
            self._keys, self._values = (_resized(b, capacity, start) for b in (self._keys, self._values))
        self._keys[:, :, start:stop] = key_states
        self._values[:, :, start:stop] = value_states
        self.length = stop
        return self._view()

    def _view(self):
        self.keys, self.values = self._keys[:, :, :self.length], self._values[:, :, :self.length]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._view()


def _resized(buffer: torch.Tensor, capacity: int, filled: int) -> torch.Tensor:
    grown = buffer.new_zeros((*buffer.shape[:2], capacity, buffer.shape[-1]))
    grown[:, :, :filled] = buffer[:, :, :filled]
    return grown


def cache() -> Cache:
    """An empty KV cache for one sampling call; its layers are created as the model first writes to them."""
    return Cache(layer_class_to_replicate=_GrowingLayer)
