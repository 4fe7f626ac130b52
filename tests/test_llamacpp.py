"""llama.cpp as the lab's second engine: the GGUF files hold the torch engines' weights, the engine returns the
book's Rollout, and at F32 it agrees with the fp32 trainer more closely than the book's own fp16 sampler does."""
import numpy as np
import pytest
import torch

from labutils import clusters, llamacpp, mismatch, models, pretrained, rollout


@pytest.fixture(scope="module")
def real():
    return models.load(pretrained.NAME, "dense", None)


def test_a_bad_type_a_missing_build_and_another_model_are_refused_in_one_sentence(monkeypatch):
    with pytest.raises(ValueError, match="choose one of f32, f16, bf16, q8_0, q4_0"):
        llamacpp.check_kind("q5_k")
    with pytest.raises(ValueError, match="convert_hf_to_gguf.py"):
        llamacpp.check_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else find(name, *a))
    with pytest.raises(ModuleNotFoundError, match="make setup"):
        llamacpp.require()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="'auto'"):
        llamacpp.Engine("f32", flash_attention="on")


def test_the_f32_file_holds_the_weights_the_torch_engines_load(real):
    import gguf

    model, _ = real
    reader = gguf.GGUFReader(llamacpp.write("f32"))
    tensors = {t.name: t for t in reader.tensors}
    state = model.state_dict()
    # tensors transformers does not permute: the embedding, an MLP projection, a norm
    for name, key in (("token_embd.weight", "model.embed_tokens.weight"),
                      ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
                      ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight")):
        values = np.asarray(tensors[name].data).reshape(state[key].shape)
        assert torch.equal(torch.from_numpy(values.copy()), state[key]), name
    q8 = {t.name: t.tensor_type.name for t in gguf.GGUFReader(llamacpp.write("q8_0")).tensors}
    assert q8["blk.3.ffn_down.weight"] == "Q8_0" and q8["blk.3.attn_norm.weight"] == "F32"


def test_rows_end_where_their_budget_says_in_the_books_rollout_shape(real):
    _, tokenizer = real
    engine = llamacpp.Engine("q8_0")
    prompts = pretrained.chat_prompts(tokenizer, 3)
    out = engine.sample(prompts, [4, 9, 6], [4, 9, 6], generator=torch.Generator().manual_seed(0), keep_vocab=1)
    engine.close()
    assert out.lengths.tolist() == [4, 9, 6] and out.completion_ids.shape == (3, 9)
    assert out.vocab_logprobs.shape == (1, 9, engine.vocab_size)
    sampled = out.vocab_logprobs[0, :4].gather(-1, out.completion_ids[0, :4, None]).squeeze(-1)
    assert torch.equal(sampled, out.logprobs[0, :4])


def test_at_f32_llama_cpp_is_closer_to_the_fp32_trainer_than_torchs_fp16_sampler(real):
    model, tokenizer = real
    prompts = pretrained.chat_prompts(tokenizer, 2)
    trainer = rollout.TrainingEngine(model, torch.float32, "cpu", micro_batch=2)
    found = {}
    for name, engine in (("llama.cpp", llamacpp.Engine("f32", flash_attention="off")),
                         ("llama.cpp, flash attention", llamacpp.Engine("f32")),
                         ("fp32", rollout.InferenceEngine(model, torch.float32)),
                         ("fp16", rollout.InferenceEngine(model, torch.float16))):
        out = engine.sample(prompts, 48, 48, keep_vocab=True, generator=torch.Generator().manual_seed(0))
        kl = mismatch.token_kl(out.vocab_logprobs, trainer.score(out, keep_vocab=True).vocab) * out.mask
        found[name] = (clusters.mean(kl, out.mask)[0], out.completion_ids)
    # the tolerance is a measured floor: one dtype step of the book's own sampler, on the same prompts
    assert found["llama.cpp"][0] < found["fp16"][0], found
    # flash attention computes attention in F16: it moves μ further than the F32 engine does without it
    assert found["llama.cpp"][0] < found["llama.cpp, flash attention"][0], found
    # with the same seed the two engines draw the same uniforms: they share longer prefixes than two seeds do
    other = rollout.InferenceEngine(model, torch.float32).sample(prompts, 48, 48,
                                                                 generator=torch.Generator().manual_seed(1))

    def shared(a, b):
        differ = a != b
        return float(torch.where(differ.any(-1), differ.int().argmax(-1), torch.tensor(48)).float().mean())

    assert shared(found["llama.cpp"][1], found["fp32"][1]) > shared(other.completion_ids, found["fp32"][1])
