"""A checkpoint as a reader brings one: byte-level BPE, no pad token, right padding, no pad_token_id.

Built offline with the `tokenizers` BPE trainer and a tiny Qwen2 config, then run through the
dense chapters' loading, both engines, the greedy evaluation and the two GRPO trainers.
"""
import dataclasses
import random

import pytest
import torch

from labutils import grpo, models, rollout, task

EOS = "</s>"


@pytest.fixture(scope="module")
def bpe_checkpoint(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    core = Tokenizer(tok_models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    corpus = [p.prompt + p.completion for p in task.sample_problems(random.Random(0), 300, 1, 8)]
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, padding_side="right")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    config.pad_token_id = None
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bpe-qwen2")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_the_checkpoint_is_the_troublesome_kind(bpe_checkpoint):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    rows = AutoModelForCausalLM.from_pretrained(bpe_checkpoint).get_input_embeddings().num_embeddings
    assert AutoConfig.from_pretrained(bpe_checkpoint).pad_token_id is None
    plain = PreTrainedTokenizerFast.from_pretrained(bpe_checkpoint)
    assert plain.pad_token is None and plain.padding_side == "right"
    assert len(plain("3+7*4=", add_special_tokens=False)["input_ids"]) < len("3+7*4=")  # merges, not characters
    auto = AutoTokenizer.from_pretrained(bpe_checkpoint)  # transformers picks the Qwen2 class by model type...
    assert auto.pad_token_id is None or auto.pad_token_id >= rows  # ...whose default pad the model never saw


def test_load_fills_in_pad_and_left_padding(bpe_checkpoint, tiny_profile, capsys):
    model, tokenizer = models.load(bpe_checkpoint, "dense", tiny_profile)
    assert "pad token = EOS" in capsys.readouterr().out
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == model.config.pad_token_id
    assert tokenizer.padding_side == "left"
    problems = task.sample_problems(random.Random(1), 6, 1, 4)
    assert 0.0 <= models.greedy_accuracy(model, tokenizer, problems) <= 1.0


def test_engines_sample_and_rescore_a_checkpoint_without_pad_id(bpe_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(bpe_checkpoint)  # as a reader loads it: no pad id anywhere
    tokenizer = AutoTokenizer.from_pretrained(bpe_checkpoint)
    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
               for p in task.sample_problems(random.Random(2), 4, 1, 6)]
    prompts[1] = prompts[1][2:]  # ragged: padding is exercised
    sampler = rollout.InferenceEngine(model, torch.float32)
    out = sampler.sample(prompts, max_new_tokens=12, generator=torch.Generator().manual_seed(0))
    scored = rollout.TrainingEngine(model, torch.float32, micro_batch=3).score(out)
    assert sampler.pad_id == tokenizer.eos_token_id
    gap = (scored.logprobs - out.logprobs)[out.mask]
    assert gap.abs().max() < 1e-4  # same weights, same precision: the engines agree on every real token


def test_grpo_trainers_run_on_the_checkpoint(bpe_checkpoint, tiny_profile, tmp_path, monkeypatch):
    def length_reward(completions, **_):  # an untrained model is never right: reward something that varies
        return [float(len(c)) for c in completions]

    monkeypatch.setattr(grpo, "exact_match_reward", length_reward)
    plan = dataclasses.replace(tiny_profile.rl, steps=1, batch_size=4, num_generations=2, min_walk=1, max_walk=3,
                               prompts=16)
    model, tokenizer = models.load(bpe_checkpoint, "dense", tiny_profile)
    sampler = grpo.EngineRollout(rollout.InferenceEngine(model, torch.float32), max_new_tokens=16, seed=0)
    args = grpo.config(tiny_profile, str(tmp_path / "engine"), plan=plan)
    engine = grpo.engine_trainer(model, tokenizer, args, tiny_profile, sampler, torch.float32, plan=plan)
    engine.train()
    assert engine.state.global_step == 1

    lora_plan = dataclasses.replace(plan, lora_rank=4, lr=tiny_profile.grpo.lr)
    qlora = grpo.qlora_trainer(dataclasses.replace(tiny_profile, grpo=lora_plan), str(tmp_path / "qlora"),
                               torch.float32, steps=1, model_id=bpe_checkpoint)
    qlora.train()
    assert qlora.state.global_step == 1


def test_the_moe_chapter_refuses_a_dense_checkpoint_before_loading_it(bpe_checkpoint, tiny_profile):
    with pytest.raises(ValueError, match="dense qwen2 model with no experts"):
        models.resolve_model(bpe_checkpoint, "moe", tiny_profile)
    assert models.resolve_model(bpe_checkpoint, "dense", tiny_profile) == bpe_checkpoint


def test_a_tokenizer_without_eos_is_refused_in_one_sentence(bpe_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(bpe_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(bpe_checkpoint)
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="has no EOS token"):
        models.complete_special_tokens(model, tokenizer)


@pytest.mark.parametrize("cls", ["PreTrainedTokenizerFast", "AutoTokenizer"])
def test_a_missing_or_unseen_pad_token_becomes_eos(bpe_checkpoint, cls):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(bpe_checkpoint)
    tokenizer = getattr(transformers, cls).from_pretrained(bpe_checkpoint)
    assert models.complete_special_tokens(model, tokenizer)[0].startswith("pad token = EOS")
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == model.config.pad_token_id


def test_list_valued_stop_ids_stay_for_generation_and_the_engines_stop_at_the_tokenizers_eos(bpe_checkpoint):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(bpe_checkpoint)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(bpe_checkpoint)
    rows = model.get_input_embeddings().num_embeddings
    model.config.eos_token_id, model.config.pad_token_id = [5, tokenizer.eos_token_id], rows + 7  # as chat checkpoints
    model.generation_config.eos_token_id = [5, tokenizer.eos_token_id]
    models.complete_special_tokens(model, tokenizer)
    assert model.generation_config.eos_token_id == [5, tokenizer.eos_token_id]
    assert rollout.special_ids(model.config) == (tokenizer.eos_token_id, tokenizer.eos_token_id)
