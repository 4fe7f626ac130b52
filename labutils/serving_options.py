"""What a real stack does besides its dtype, applied to the book's engines: each option moves μ or π.

* `fp32_head`: the LM head computed in fp32 from the fp32 weights (as trl's `cast_lm_head_to_fp32` asks),
  whatever the engine's dtype; the tied embedding stays as it was.
* `Nucleus`: top-p sampling. The sampler draws from its own tempered distribution cut to its smallest set of
  tokens with mass ≥ p, renormalised; a trainer that scores the full distribution then sees
  KL[μ‖π] = −log(kept mass) per token where the engines otherwise agree (the closed form).
* `raw_logprobs`: the log-probabilities a server returns before its temperature, log_softmax(T · processed),
  exact for the full distribution; vLLM V1's sampler returns these by default
  (`logprobs_mode="raw_logprobs"`, vllm/v1/sample/sampler.py, `Sampler.__init__`).
* `lora_pair`: a LoRA policy as the sampler receives it (merged, then cast) and as the trainer computes it
  (unmerged), `lora_serving`'s two views.
"""
from __future__ import annotations

import torch

from . import lora_serving, sampler_precision


class FP32Head(torch.nn.Module):
    """The LM head in fp32: hidden states upcast, fp32 weights, autocast off."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().float().clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.nn.functional.linear(hidden.float(), self.weight)


def fp32_head(engine, fp32_model) -> None:
    """Give `engine`'s private model an fp32 head built from `fp32_model`'s head weights."""
    head = fp32_model.get_output_embeddings().weight
    engine.model.set_output_embeddings(FP32Head(head).to(head.device))


class Nucleus:
    """Top-p truncation of a torch sampler's next-token logits, and the mass each truncation kept.

    A forward hook on the engine's model: at the last position it bans EOS where the engine will (every
    step here: the doctor bans it until the last token), tempers, keeps the smallest set of tokens whose
    mass reaches `top_p` (at least one), and sets the rest to −inf; the engine then tempers and normalises
    as usual, so its log μ is the truncated distribution's.
    """

    def __init__(self, engine, top_p: float, temperature: float):
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1].")
        self.top_p, self.temperature, self.eos_id = top_p, temperature, engine.eos_id
        self.kept: list[torch.Tensor] = []  # per step, the kept mass of each row
        self._hook = engine.model.register_forward_hook(self._cut)

    def _cut(self, module, args, output) -> None:
        logits = output.logits[:, -1]
        z = logits.float().clone()  # a copy even when the logits are fp32: the engine bans EOS itself
        z[:, self.eos_id] = float("-inf")
        probs = torch.softmax(z / self.temperature, dim=-1)
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the tokens ranked above each one
        keep_sorted = before < self.top_p  # the first token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        self.kept.append((probs * keep).sum(-1).cpu())
        logits.masked_fill_(~keep, float("-inf"))  # in place: the engine reads these logits next

    def kept_mass(self) -> torch.Tensor:
        """[rows, steps]: the mass of the sampler's tempered distribution each step kept (the prefill's step
        first); the closed form −log(kept mass) is exact where that distribution is the trainer's π."""
        return torch.stack(self.kept, dim=-1)

    def remove(self) -> None:
        self._hook.remove()


def raw_logprobs(processed: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities before temperature from tempered ones over the whole vocabulary: log_softmax(T·x)."""
    return torch.log_softmax(temperature * processed.double(), dim=-1).float()


def lora_pair(model, size: float, rank: int, sampler_name: str, trainer_dtype: torch.dtype, device: str,
              micro_batch: int, seed: int):
    """A random LoRA adapter of relative size `size` on every decoder linear of `model`; the sampler built
    from its merged weights (`sampler_name` on the dial) and the trainer that applies it unmerged."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(sampler_precision.DECODER_LINEARS))
    policy = get_peft_model(copy.deepcopy(model), config)
    lora_serving.size_adapters(policy, size, seed)
    policy = policy.float().eval()
    sampler = sampler_precision.engine(lora_serving.merged_copy(policy, torch.float32, device), sampler_name, device)
    trainer = lora_serving.UnmergedTrainingEngine(policy, trainer_dtype, trainer_dtype, device, micro_batch)
    return sampler, trainer
