"""labutils.grpo: the fp16 engine's loss scaler, gradient snapshots, and the dtype audits of chapter 2."""
import dataclasses

import pytest
import torch

from labutils import grpo, models, rollout, task


def test_flushed_fraction_counts_zeros_where_the_reference_is_nonzero():
    reference = {"w": torch.tensor([1e-3, 2.0, 0.0, -4.0]), "b": torch.tensor([5.0, 0.0])}
    grads = {"w": torch.tensor([0.0, 2.0, 0.0, 0.0]), "b": torch.tensor([5.0, 1.0])}
    assert grpo.flushed_fraction(grads, reference) == pytest.approx(2 / 4)  # 4 nonzero reference entries, 2 flushed
    assert grpo.flushed_fraction(reference, reference) == 0.0


def test_dtype_audits_read_parameters_and_adam_state():
    layer = torch.nn.Linear(4, 2).to(torch.bfloat16)
    layer.register_parameter("frozen", torch.nn.Parameter(torch.zeros(1), requires_grad=False))  # fp32, not trained
    assert grpo.trainable_dtypes(layer) == "bfloat16"
    optimizer = torch.optim.AdamW([layer.weight, layer.bias])
    assert grpo.optimizer_state_dtypes(optimizer) == ""  # no step yet: no state
    layer(torch.ones(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    assert grpo.optimizer_state_dtypes(optimizer) == "bfloat16"  # AdamW keeps its moments in the parameter's dtype
    assert grpo.optimizer_state_dtypes(None) == ""


def test_lora_probe_sees_peft_cast_the_input_to_the_adapter_dtype():
    from peft import LoraConfig, get_peft_model

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x)

    model = get_peft_model(Tiny(), LoraConfig(r=2, target_modules=["proj"]))
    grpo.cast_trainables(model, torch.bfloat16)
    probe = grpo.LoraDtypeProbe(model)
    model(torch.randn(2, 8))
    seen = probe.dtypes()
    probe.remove()
    assert seen["base_input"] == "float32" and seen["lora_input"] == "bfloat16" and seen["lora_output"] == "bfloat16"
    model(torch.randn(2, 8))
    assert probe.dtypes() == seen  # removed hooks record nothing more


def length_reward(completions, **_):
    """A reward that differs between completions of an untrained model, so the advantages are not all zero."""
    return [float(len(c)) for c in completions]


def _engine_run(profile, lab, train_dtype, scale, tmp_path, steps=2):
    model, tokenizer = lab
    plan = dataclasses.replace(profile.rl, steps=steps, batch_size=4, num_generations=2, min_walk=1, max_walk=3,
                               prompts=16)
    sampler = grpo.EngineRollout(rollout.InferenceEngine(model, train_dtype, "cpu"),
                                 max_new_tokens=task.completion_length(plan.max_walk) + 1, seed=0)
    args = grpo.config(profile, str(tmp_path / f"{train_dtype}-{scale}"), seed=0, plan=plan)
    trainer = grpo.engine_trainer(model, tokenizer, args, profile, sampler, train_dtype, seed=0, plan=plan)
    scaler = trainer.add_loss_scaler() if scale else None
    snapshot = grpo.gradient_snapshot()
    trainer.add_callback(snapshot)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    return trainer, scaler, snapshot, before


def test_fp16_engine_gets_a_scaler_that_scales_unscales_before_clipping_and_steps(tiny_profile, lab_cache, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setattr(grpo, "exact_match_reward", length_reward)
    torch.manual_seed(0)
    lab = models.load(None, "dense", tiny_profile, seed=0)
    trainer, scaler, snapshot, before = _engine_run(tiny_profile, lab, torch.float16, True, tmp_path)
    assert isinstance(scaler, torch.amp.GradScaler) and trainer.accelerator.scaler is scaler
    scales = [e["loss_scale"] for e in trainer.state.log_history if "loss_scale" in e]
    assert len(scales) == 2 and scales[0] == 2.0**16
    changed = any(not torch.equal(before[n], p) for n, p in lab[0].named_parameters())
    assert changed and trainer.state.global_step == 2
    scaled_norm = next(e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e)
    scaled_grads = snapshot.grads

    torch.manual_seed(0)
    lab = models.load(None, "dense", tiny_profile, seed=0)
    plain, none, plain_snapshot, _ = _engine_run(tiny_profile, lab, torch.float16, False, tmp_path)
    assert none is None and plain.accelerator.scaler is None
    plain_norm = next(e["grad_norm"] for e in plain.state.log_history if "grad_norm" in e)
    # the same first batch: the logged norm is the true one (unscaled before clipping), not 2^16 times larger
    assert 0.5 < scaled_norm / plain_norm < 2.0
    assert set(scaled_grads) == set(plain_snapshot.grads) and 0.0 <= grpo.flushed_fraction(plain_snapshot.grads,
                                                                                             scaled_grads) < 0.5


def test_an_fp16_engine_logs_the_scale_of_accelerates_own_scaler_where_accelerate_built_one(
        tiny_profile, lab_cache, tmp_path, monkeypatch):
    # on CUDA accelerate builds the GradScaler itself: the trace must follow that scaler, not stay empty
    monkeypatch.setattr(grpo, "exact_match_reward", length_reward)
    model, tokenizer = models.load(None, "dense", tiny_profile, seed=0)
    plan = dataclasses.replace(tiny_profile.rl, steps=2, batch_size=4, num_generations=2, min_walk=1, max_walk=3,
                               prompts=16)
    sampler = grpo.EngineRollout(rollout.InferenceEngine(model, torch.float16, "cpu"),
                                 max_new_tokens=task.completion_length(plan.max_walk) + 1, seed=0)
    args = grpo.config(tiny_profile, str(tmp_path / "accelerate"), seed=0, plan=plan)
    trainer = grpo.engine_trainer(model, tokenizer, args, tiny_profile, sampler, torch.float16, seed=0, plan=plan)
    accelerates = trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert trainer.add_loss_scaler() is accelerates and trainer.own_loss_scaler is None
    trainer.train()
    scales = [e["loss_scale"] for e in trainer.state.log_history if "loss_scale" in e]
    assert len(scales) == 2 and scales[0] == 2.0**10


def test_only_fp16_engines_get_a_scaler(tiny_profile, lab_cache, tmp_path):
    model, tokenizer = models.load(None, "dense", tiny_profile, seed=0)
    plan = dataclasses.replace(tiny_profile.rl, steps=1, batch_size=4, num_generations=2, min_walk=1, max_walk=3,
                               prompts=16)
    for dtype in (torch.float32, torch.bfloat16):
        args = grpo.config(tiny_profile, str(tmp_path / str(dtype)), plan=plan)
        trainer = grpo.engine_trainer(model, tokenizer, args, tiny_profile, None, dtype, plan=plan)
        assert trainer.add_loss_scaler() is None and trainer.own_loss_scaler is None
