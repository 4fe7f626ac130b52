import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from labutils import models


def test_tokenizer_is_character_level_and_round_trips(tmp_path):
    tok = models.build_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    text = "12:3+7=0;1"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.decode(ids) == text
    assert again.pad_token == "<pad>" and again.eos_token == "<eos>" and again.padding_side == "left"


def test_configs_dense_and_moe(tiny_profile):
    tok = models.build_tokenizer()
    dense = models.build_config(tiny_profile.dense, tok)
    moe = models.build_config(tiny_profile.moe, tok)
    assert dense.model_type == "qwen2" and moe.model_type == "mixtral"
    assert moe.num_local_experts == 4 and moe.num_experts_per_tok == 2
    assert dense.vocab_size == len(tok)


@pytest.mark.parametrize("kind", models.KINDS)
def test_build_is_cached_and_loaded_through_auto_classes(kind, tiny_profile, lab_cache):
    path = models.lab_model_dir(kind, tiny_profile, seed=0)
    assert path.parent == lab_cache / "models"
    stamp = os.path.getmtime(path / "model.safetensors")
    assert models.lab_model_dir(kind, tiny_profile, seed=0) == path  # no rebuild
    assert os.path.getmtime(path / "model.safetensors") == stamp
    model, tok = models.load(kind=kind, profile=tiny_profile)
    assert type(model).__name__ == ("Qwen2ForCausalLM" if kind == "dense" else "MixtralForCausalLM")
    assert models.lab_metadata(path)["warmup"]["steps"] == 3
    assert 0.0 <= models.greedy_accuracy(model, tok, models.eval_problems(tiny_profile)) <= 1.0


def test_build_is_deterministic(tiny_profile, lab_cache):
    first = models.lab_model_dir("dense", tiny_profile, seed=0)
    weights = AutoModelForCausalLM.from_pretrained(first).state_dict()
    again = models.lab_model_dir("dense", tiny_profile, seed=0, rebuild=True)
    for name, tensor in AutoModelForCausalLM.from_pretrained(again).state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_seed_changes_the_cache_key(tiny_profile):
    assert models.build_key("dense", tiny_profile.dense, tiny_profile.warmup, 0) != \
        models.build_key("dense", tiny_profile.dense, tiny_profile.warmup, 1)


def test_corrupt_cache_is_rebuilt(tiny_profile, lab_cache):
    path = models.lab_model_dir("dense", tiny_profile)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    model, _ = models.load(kind="dense", profile=tiny_profile)
    assert isinstance(model, torch.nn.Module)


def test_missing_model_directory_is_named(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.resolve_model(missing, "dense", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without config.json"):
        models.resolve_model(str(tmp_path / "empty"), "dense", None)


def test_model_id_directory_is_used_as_is(tiny_profile, lab_cache):
    path = models.lab_model_dir("dense", tiny_profile)
    assert models.resolve_model(str(path), "dense", tiny_profile) == str(path)
    assert models.resolve_model("Qwen/Qwen2.5-0.5B", "dense", tiny_profile) == "Qwen/Qwen2.5-0.5B"


def test_unknown_kind():
    with pytest.raises(ValueError, match="choose one of"):
        models.lab_model_dir("sparse", None)
