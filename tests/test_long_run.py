"""The long run behind chapter 5b: its three phases in miniature, its provenance, and the committed file."""
import dataclasses
import json

from labutils import committed, long_run, profiles


def _fingerprint(profile):
    return long_run.RUN.fingerprint(long_run.plan_read(profile))


def test_the_committed_long_run_was_made_by_this_code_and_this_lab_model():
    payload, why = long_run.load()
    assert why is None, why
    assert payload["design"]["long"]["eval_problems"] >= 512


def test_its_chosen_rate_passed_on_the_sweep_and_again_on_fresh_control_seeds():
    design = long_run.load()[0]["design"]
    chosen = design["chosen_lr"]
    assert design["sweep"][f"{chosen:g}"]["stable"] and design["validation"][f"{chosen:g}"]["stable"]
    # every larger stable rate was checked first and failed there
    larger = [lr for lr, found in design["sweep"].items() if found["stable"] and float(lr) > chosen]
    assert all(not design["validation"][lr]["stable"] for lr in larger)


def test_a_file_from_other_code_is_refused_in_one_sentence():
    cpu = profiles.PROFILES["cpu"]
    payload = {"provenance": {"code": "0" * 16, "model": long_run.model_fingerprint(cpu)}}
    said = long_run.RUN.stale(payload, long_run.plan_read(cpu), long_run.model_fingerprint(cpu))
    assert said.count(". ") == 0 and said.endswith(".") and "make long" in said


def test_the_fingerprint_covers_the_modules_the_run_imports_and_not_the_chapters_helpers():
    modules = committed.modules_run("long_run")
    assert {"long_run", "mismatch_rl", "grpo", "rollout", "sampler_precision", "rl_design"} <= set(modules)
    assert not {"rl_analysis", "readings", "plots", "results"} & set(modules)


def test_the_three_phases_run_and_record_what_the_chapter_reads(tmp_path, tiny_profile, lab_cache):
    # the tiny model and one-step runs of short walks: the phases' plumbing, not their numbers
    cpu = profiles.PROFILES["cpu"]
    tiny = dataclasses.replace(cpu.sampler.long, steps=1, lrs=(1e-4, 5e-5), sweep_seeds=2, eval_problems=4,
                               eval_every=1, min_gain=-1.0, max_fix_seeds=2, budget_minutes=60)
    plan = dataclasses.replace(cpu.sampler_rl, batch_size=4, num_generations=2, min_walk=1, max_walk=2, prompts=16)
    profile = dataclasses.replace(tiny_profile, sampler=dataclasses.replace(cpu.sampler, long=tiny), sampler_rl=plan)
    path = long_run.run(tmp_path / "long.json", workers=1, profile=profile, dose=("m2", "bf16"))
    found = json.loads(path.read_text())
    design, curves = found["design"], found["curves"]
    assert design["chosen_lr"] == 1e-4  # every rate passes a gain of -1, twice: the largest is chosen
    assert set(design["validation"]) == {"0.0001"} and len(curves["validation"]["0.0001"]) == 2
    assert set(design["sweep"]) == {"0.0001", "5e-05"} and design["seeds_needed"] >= 2
    assert set(curves["dose"]) == {"m2", "bf16", "fp32"} and len(curves["dose"]["m2"]) == 2
    assert set(curves["fix"]) == set(design["roles"].values())
    assert design["fix_seeds"][0] == long_run.FIX_SEED0
    assert found["provenance"]["code"] == _fingerprint(profile)


def test_the_fingerprint_follows_the_plan_the_run_reads_and_not_the_other_chapters_plans():
    cpu = profiles.PROFILES["cpu"]
    longer = dataclasses.replace(cpu, sampler=dataclasses.replace(
        cpu.sampler, long=dataclasses.replace(cpu.sampler.long, steps=cpu.sampler.long.steps + 1)))
    assert _fingerprint(longer) != _fingerprint(cpu)
    other = dataclasses.replace(cpu, real=dataclasses.replace(cpu.real, length=cpu.real.length + 1))
    assert _fingerprint(other) == _fingerprint(cpu)
    # the chapter's own short runs and offline dial are not the long run's
    short = dataclasses.replace(cpu, sampler=dataclasses.replace(cpu.sampler, dial_length=cpu.sampler.dial_length + 1),
                                sampler_rl=dataclasses.replace(cpu.sampler_rl, steps=cpu.sampler_rl.steps + 1))
    assert _fingerprint(short) == _fingerprint(cpu)
