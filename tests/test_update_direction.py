"""Chapter 5c's measurement: the coupling, the estimators, trl's advantages, and the committed run."""
import json

import pytest
import torch

from labutils import committed, direction_stats, models, sampler_precision, update_direction


def test_the_committed_run_was_made_by_this_code_and_model():
    payload, why_not = update_direction.load()
    assert why_not is None, why_not
    assert payload["completions"] == payload["batches"] * payload["plan"]["prompts"] * payload["plan"]["group"]
    gram = direction_stats.Gram(payload["gram"])
    for name, sampler in payload["samplers"].items():  # the recorded ρ is the Gram matrix's, recomputed
        if name != "fp32":
            for correction, measured in sampler["corrections"].items():
                assert gram.rho((name, correction))[0] == pytest.approx(measured["rho"], rel=1e-6, abs=1e-9)


def test_a_file_from_other_code_is_refused_in_one_sentence():
    said = update_direction.RUN.stale({"provenance": {"code": "0" * 16}}, update_direction.PLAN, "model")
    assert said.count(". ") == 0 and said.endswith(".") and "make direction" in said


def test_the_fingerprint_covers_the_engines_and_the_plan():
    assert {"update_direction", "committed", "rollout", "sampler_precision"} <= set(committed.modules_run("update_direction"))
    other = dict(update_direction.PLAN, length=update_direction.PLAN["length"] + 1)
    assert update_direction.RUN.fingerprint(other) != update_direction.RUN.fingerprint(update_direction.PLAN)


def _common_prefix(a, b):
    differ = a.completion_ids != b.completion_ids
    return torch.where(differ.any(-1), differ.int().argmax(-1), torch.tensor(differ.shape[1]))


def test_coupled_samplers_agree_until_their_first_difference(tiny_profile, lab_cache):
    model, _ = models.load(None, "dense", tiny_profile, seed=0)
    ids = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 1]] * 2
    fp32 = update_direction.sample(sampler_precision.engine(model, "fp32"), ids, 96, seed=3)
    again = update_direction.sample(sampler_precision.engine(model, "fp32"), ids, 96, seed=3)
    assert torch.equal(fp32.completion_ids, again.completion_ids)  # identical weights: identical completions
    unrelated = update_direction.sample(sampler_precision.engine(model, "fp32"), ids, 96, seed=4)
    independent = _common_prefix(unrelated, fp32)
    for name in ("bf16", "m2"):
        other = update_direction.sample(sampler_precision.engine(model, name), ids, 96, seed=3)
        shared = _common_prefix(other, fp32)
        print(f"{name} leaves fp32 at tokens {shared.tolist()} of 96; another seed at {independent.tolist()}")
        for row, at in enumerate(shared.tolist()):  # token for token up to the row's first difference
            assert torch.equal(other.completion_ids[row, :at], fp32.completion_ids[row, :at])
        assert shared.float().mean() > independent.float().mean(), name


def test_the_cross_batch_products_are_the_mean_over_distinct_pairs():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    labels = [f"a/none/{b}" for b in range(5)] + [f"b/none/{b}" for b in range(5)]
    stacked = torch.cat([x, y]).double()
    gram = direction_stats.Gram({"labels": labels, "matrix": (stacked @ stacked.T).tolist()})
    value, loo = gram.cross(("a", "none"), ("b", "none"))
    pairs = [float(x[i] @ y[j]) for i in range(5) for j in range(5) if i != j]
    assert value == pytest.approx(sum(pairs) / len(pairs))
    left = [float(x[i] @ y[j]) for i in range(1, 5) for j in range(1, 5) if i != j]
    assert float(loo[0]) == pytest.approx(sum(left) / len(left))
    # 1 − ρ's numerator, tested without dividing by the reference's noisy norm
    loss, loss_loo = gram.loss(("a", "none"), ("b", "none"))
    assert loss == pytest.approx(gram.cross(("b", "none"), ("b", "none"))[0] - value)
    assert gram.loss(("b", "none"), ("b", "none"))[0] == 0.0
    assert torch.allclose(loss_loo, gram.cross(("b", "none"), ("b", "none"))[1] - loo)
    # the run's own estimator is the same statistic
    assert update_direction.direction(x, y)["rho"] == pytest.approx(
        gram.rho(("a", "none"), ("b", "none"))[0])


def test_an_update_equal_to_the_reference_keeps_all_of_it_and_a_scaled_one_its_scale():
    ref = torch.randn(6, 9, generator=torch.Generator().manual_seed(1))
    same = update_direction.direction(ref, ref)
    assert same["rho"] == pytest.approx(1.0) and same["orth"] == pytest.approx(0.0, abs=1e-9)
    assert same["rho_se"] == pytest.approx(0.0, abs=1e-9)
    assert update_direction.direction(0.5 * ref, ref)["rho"] == pytest.approx(0.5)


def test_advantages_are_trls_group_normalised_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = update_direction.advantages(rewards, group=4)
    first = rewards[:4]
    assert torch.allclose(adv[:4], (first - first.mean()) / (first.std() + 1e-4))  # trl's unbiased std
    assert torch.equal(adv[4:], torch.zeros(4))  # a group with one reward teaches nothing


def test_trls_default_correction_masks_whole_completions_and_tis_clips_tokens():
    log_ratio = torch.tensor([[0.5, 0.5, 0.5], [0.01, -0.02, 0.0]])  # the first completion's π/μ is e^1.5 > 3
    masked, cut = update_direction.correction_weights(log_ratio, "sequence_mask")
    assert torch.equal(masked[0], torch.zeros(3)) and bool((masked[1] > 0.9).all()) and cut == 0.5
    clipped, cut = update_direction.correction_weights(log_ratio, "tis")
    assert torch.allclose(clipped, torch.exp(log_ratio).clamp(max=2.0)) and cut == 0.0
    assert torch.equal(update_direction.correction_weights(log_ratio, "none")[0], torch.ones(2, 3))


def test_the_verdicts_follow_the_interval_and_the_margin():
    assert direction_stats.verdict(0.3, 0.05, 0.05) == "shown"
    assert direction_stats.verdict(0.01, 0.01, 0.05) == "contradicted"
    assert direction_stats.verdict(0.04, 0.05, 0.05) == "unresolved"
    assert update_direction.power(0.01, 0.05, 0.05) > 0.99 and update_direction.power(0.1, 0.05, 0.05) < 0.2
    assert update_direction.completions_for(0.1, 100, 0.05, 0.05) == pytest.approx(100 * (0.1 / 0.05 * 2.8) ** 2, rel=0.01)


def test_a_committed_run_writes_its_fingerprint_and_reads_back(tmp_path):
    run = committed.Run("example", module="update_direction", make="make example")
    target = run.write({"value": 1}, {"size": 2}, "model-a", 0.0, tmp_path / "example.json")
    payload = json.loads(target.read_text())
    assert run.stale(payload, {"size": 2}, "model-a") is None
    assert "make example" in run.stale(payload, {"size": 3}, "model-a")
    assert "make example" in run.stale(payload, {"size": 2}, "model-b")


def test_the_committed_inner_products_are_the_updates_products():
    g = torch.Generator().manual_seed(2)
    found = {"kept": {"fp32": {"sketch": {"none": [torch.randn(10, generator=g) for _ in range(3)]}},
                      "m3": {"sketch": {"none": [torch.randn(10, generator=g) for _ in range(3)],
                                        "tis": [torch.randn(10, generator=g) for _ in range(3)]}}}}
    gram = update_direction.gram(found, chunk=4)  # slices that do not divide the length
    vectors = [v for r in found["kept"].values() for kept in r["sketch"].values() for v in kept]
    expected = torch.stack(vectors).double() @ torch.stack(vectors).double().T
    assert gram["labels"][3] == "m3/none/0"
    assert torch.allclose(torch.tensor(gram["matrix"], dtype=torch.float64), expected)
