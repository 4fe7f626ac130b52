import types

import pytest
import torch

from labutils import preflight, trace


def test_source_lines_cites_file_and_line():
    text = trace.source_lines(trace.source_lines, r"inspect\.getsourcelines")
    assert "trace.py" in text.splitlines()[0] and "| " in text
    with pytest.raises(LookupError, match="library changed"):
        trace.source_lines(trace.source_lines, "no such text anywhere 123")


def _model(dtype, quantized=False):
    model = torch.nn.Linear(2, 2).to(dtype)
    model.is_loaded_in_4bit = quantized
    return model


def _args(**flags):
    return types.SimpleNamespace(**{"fp16": False, "bf16": False, "adam_epsilon": 1e-8, "use_cpu": False, **flags})


def codes(model, args, **kw):
    return sorted(f.code for f in preflight.check(model, args, **kw))


def test_crash_configuration_is_found_on_cuda():
    assert codes(_model(torch.bfloat16), _args(fp16=True), device="cuda") == ["fp16_scaler_bf16_trainables"]


def test_quantized_model_predicted_before_the_trainer_casts():
    model = _model(torch.float32, quantized=True)
    assert codes(model, _args(fp16=True), device="cuda", before_trainer=True) == ["fp16_scaler_bf16_trainables"]
    assert codes(model, _args(fp16=True), device="cuda") == []  # fp32 trainables after the trainer: the fix


def test_fp16_trainables_under_a_scaler_and_eps_underflow():
    found = codes(_model(torch.float16), _args(fp16=True), device="cuda")
    assert found == ["adam_eps_underflow", "fp16_scaler_fp16_trainables"]
    # 1e-4 is representable in fp16 but still lets a flushed v take a step of 50 lr: flagged
    assert "adam_eps_underflow" in codes(_model(torch.float16), _args(adam_epsilon=1e-4), device="cpu")
    assert codes(_model(torch.float16), _args(fp16=True, adam_epsilon=1e-2), device="cuda") == \
        ["fp16_scaler_fp16_trainables"]


def test_eps_floor_follows_beta2():
    # the floor is sqrt(2^-25 / (1 - beta2)): 5.5e-3 at beta2 = 0.999, 7.7e-4 at 0.95
    assert codes(_model(torch.float16), _args(adam_epsilon=1e-3, adam_beta2=0.95), device="cpu") == []
    assert codes(_model(torch.float16), _args(adam_epsilon=1e-3, adam_beta2=0.999), device="cpu") == \
        ["adam_eps_underflow"]
    assert codes(_model(torch.float32), _args(adam_epsilon=1e-8), device="cpu") == []  # fp32 state: no floor


def test_source_lines_names_files_inside_their_package():
    import torch.optim

    first = trace.source_lines(torch.optim.AdamW.__init__, r"eps").splitlines()[0]
    assert first == "torch/optim/adamw.py"
    assert trace.source_lines(trace.source_lines, r"getsourcelines").splitlines()[0] == "labutils/trace.py"


def test_bf16_on_an_old_gpu():
    assert codes(_model(torch.float32), _args(bf16=True), device="cuda", capability=(7, 5)) == ["bf16_unsupported_gpu"]
    assert codes(_model(torch.float32), _args(bf16=True), device="cuda", capability=(9, 0)) == []


def test_fp16_on_cpu_and_both_flags():
    assert codes(_model(torch.float32), _args(fp16=True), device="cpu") == ["fp16_on_cpu"]
    assert "both_flags" in codes(_model(torch.float32), {"fp16": True, "bf16": True}, device="cpu")


@pytest.mark.parametrize("dtype, flags", [
    (torch.float32, {}),                       # fix 1: fp32 throughout
    (torch.bfloat16, {"bf16": True}),          # fix 2: bf16 consistently
    (torch.float32, {"fp16": True}),           # fix 3: fp16 mixed precision, fp32 trainables
])
def test_no_false_alarms_on_the_fixes(dtype, flags):
    assert preflight.check(_model(dtype), _args(**flags), device="cuda", capability=(8, 0)) == []


def test_assert_ok_raises_with_findings():
    with pytest.raises(preflight.PrecisionConfigError) as err:
        preflight.assert_ok(_model(torch.bfloat16), _args(fp16=True), device="cuda")
    assert err.value.findings[0].code == "fp16_scaler_bf16_trainables"
    assert "BFloat16" in str(err.value)
    preflight.assert_ok(_model(torch.float32), _args(), device="cuda")  # clean: no raise


def test_bad_device_is_named():
    with pytest.raises(ValueError, match="pass 'cpu' or 'cuda'"):
        preflight.check(_model(torch.float32), _args(), device="tpu")
