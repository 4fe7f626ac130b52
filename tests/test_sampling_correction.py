"""The book's copy of trl's importance-sampling correction gives what trl's own lines give on the same inputs."""
import ast
import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch

from labutils import sampling_correction


def trl_lines():
    """The body of trl's `if self.use_vllm and self.vllm_importance_sampling_correction:` block that computes
    the ratio, compiled to run on its own."""
    from trl import GRPOTrainer

    source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.If) and ast.unparse(node.test) == "self.use_vllm and self.vllm_importance_sampling_correction"
                and "per_token_logps_diff" in ast.unparse(node)):
            return compile(ast.Module(body=node.body, type_ignores=[]), "trl", "exec")
    pytest.fail("trl's importance-sampling block was not found: the installed trl computes it elsewhere")


@pytest.mark.parametrize("mode", sampling_correction.MODES)
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0)])
def test_weights_equal_trls_own_lines(mode, bounds):
    torch.manual_seed(0)
    sampler = -torch.rand(6, 9) * 3
    trainer = sampler + torch.randn(6, 9) * 0.4
    mask = torch.ones(6, 9)
    mask[2, 5:] = 0
    mask[4, 1:] = 0
    scope = {"torch": torch, "math": math, "old_per_token_logps": trainer, "sampling_per_token_logps": sampler,
             "completion_mask": mask, "tool_mask": None,
             "self": SimpleNamespace(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=bounds[0],
                                     vllm_importance_sampling_clip_max=bounds[1])}
    exec(trl_lines(), scope)
    ours = sampling_correction.weights(trainer - sampler, mask, mode, *bounds)
    assert torch.equal(ours, scope["vllm_importance_sampling_ratio"])


def test_sequence_mask_zeroes_a_completion_whose_weight_passes_the_cap():
    log_ratio = torch.tensor([[0.5, 0.7], [-0.2, -0.3]])  # e^1.2 > 3: masked; e^-0.5: kept, no lower bound
    w = sampling_correction.weights(log_ratio, torch.ones_like(log_ratio), "sequence_mask", None, 3.0)
    assert w[0, 0] == 0 and w[1, 0] == pytest.approx(math.exp(-0.5))
    found = sampling_correction.by_length(log_ratio, (1, 2), "sequence_mask")
    assert found[2]["cut_share"] == 0.5 and found[1]["cut_share"] == 0.0
    tokens = sampling_correction.by_length(torch.tensor([[0.5, 1.5]]), (2,), "token_truncate", None, 3.0)
    assert tokens[2]["cut_share"] == 0.5  # e^1.5 > 3 is clipped, e^0.5 is not
    assert tokens[2]["mean"] == pytest.approx((math.exp(0.5) + 3.0) / 2)
    with pytest.raises(ValueError, match="past the 2 tokens"):
        sampling_correction.by_length(log_ratio, (3,), "sequence_mask")
    with pytest.raises(ValueError, match="not one of trl's"):
        sampling_correction.weights(log_ratio, torch.ones_like(log_ratio), "sequence", None, 3.0)


def test_defaults_are_read_from_the_installed_trl():
    found = sampling_correction.defaults()
    assert found["mode"] in sampling_correction.MODES and isinstance(found["on"], bool)
