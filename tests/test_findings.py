"""The findings page: its numbers and link statuses come from the results, and its links point at real sections."""
import json
import re
from pathlib import Path

import pytest

from bookbuild import findings, layout

ROOT = Path(__file__).resolve().parent.parent


def _write(root: Path, chapter: str, metrics: dict) -> None:
    folder = root / "_build" / "results"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{chapter}.json").write_text(json.dumps({"chapter": chapter, "profile": "cpu", "seconds": 1.0,
                                                         "env": {"device": "cpu"}, "metrics": metrics}))


REAL = {"real.token_kl.bf16": 1.7e-3, "real.token_kl_stderr.bf16": 5e-5,
        "real.token_kl.fp16": 2.7e-5, "real.token_kl_stderr.fp16": 2e-6, "real.drift_settled": True}


def test_every_evidence_names_a_chapter_of_the_book_and_one_of_its_headings():
    stems = set(layout.chapters())
    for finding in findings.FINDINGS:
        assert finding.evidence, finding.situation
        for evidence in finding.evidence:
            assert evidence.chapter in stems
            headings = re.findall(r"^#+ (.+)$", (ROOT / "chapters" / f"{evidence.chapter}.md").read_text(), re.M)
            assert evidence.section in headings, (evidence.chapter, evidence.section)


def test_without_results_every_number_says_so_and_nothing_is_shown(tmp_path):
    text = findings.page(tmp_path, tmp_path / "site")
    assert "not measured in this build" in text
    assert {status for _, status, _ in findings.chain(tmp_path)} == {findings.NOT_TESTED}
    assert (tmp_path / "site" / findings.FIGURES / "chain.svg").is_file()


def test_the_mismatch_links_follow_the_real_models_numbers(tmp_path):
    _write(tmp_path, "04b_real_mismatch", REAL)
    links = findings.chain(tmp_path)
    assert [status for _, status, _ in links[:2]] == [findings.SHOWN_LINK, findings.SHOWN_LINK]
    _write(tmp_path, "04b_real_mismatch", REAL | {"real.token_kl.bf16": 2.9e-5, "real.drift_settled": False})
    links = findings.chain(tmp_path)  # within 3 standard errors of fp16, and a drift the fit cannot settle
    assert [status for _, status, _ in links[:2]] == [findings.UNRESOLVED, findings.UNRESOLVED]


def test_a_finding_quotes_this_builds_numbers(tmp_path):
    _write(tmp_path, "04b_real_mismatch", REAL | {"real.ratio.bf16_over_fp16": 63.0, "real.ratio.bf16_over_fp16_low": 50.0,
                                                  "real.ratio.bf16_over_fp16_high": 76.0, "real.seq_kl_1k.bf16": 1.75})
    text = findings.page(tmp_path, tmp_path / "site")
    assert "63× (95% interval 50–76×)" in text


@pytest.mark.parametrize("slope, verdict", [(-0.05, findings.SHOWN_LINK), (-0.01, findings.UNRESOLVED)])
def test_the_rl_link_reads_the_chapters_dose_response(tmp_path, slope, verdict):
    _write(tmp_path, "05b_sampler_precision", {
        "decisive.basis": "long run", "decisive.bits": 2, "decisive.dose_slope": slope,
        "decisive.dose_slope_low": slope - 0.02, "decisive.dose_slope_high": slope + 0.02, "decisive.dose_runs": 40,
        "decisive.dose_effect": 0.005, "decisive.gap_matched": 0.1, "decisive.noise_matched": 0.05,
        "decisive.effect": 0.05, "decisive.dose_settings": 8, "decisive.coarse_seq_kl": 8.0})
    assert dict((text, status) for text, status, _ in findings.chain(tmp_path))[
        "RL on mismatched samples degrades the policy"] == verdict


def test_the_quoted_trl_defaults_are_the_installed_ones():
    from trl import GRPOConfig

    defaults = findings.installed_defaults()
    assert defaults["trl_is_mode"] == f"`{GRPOConfig.__dataclass_fields__['vllm_importance_sampling_mode'].default}`"
    assert defaults["trl_is_clip"] == f"`{GRPOConfig.__dataclass_fields__['vllm_importance_sampling_clip_max'].default}`"
