"""The findings page: its words and link statuses follow the results, it reads the real model's numbers wherever a
chapter records them, its config blocks fit the column, and its links point at real sections."""
import json
import re
from pathlib import Path

import pytest

from bookbuild import findings, layout, quantities

ROOT = Path(__file__).resolve().parent.parent


def _write(root: Path, chapter: str, metrics: dict) -> None:
    folder = root / "_build" / "results"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{chapter}.json"
    old = json.loads(path.read_text())["metrics"] if path.is_file() else {}
    path.write_text(json.dumps({"chapter": chapter, "profile": "cpu", "seconds": 1.0,
                                "env": {"device": "cpu"}, "metrics": old | metrics}))


def _card(text: str, key: str) -> str:
    """One situation's card, from its label to the next one's."""
    start = text.index(f"(findings-{key})=")
    end = text.find("(findings-", start + 1)
    return text[start:end]


REAL = {"real.token_kl.bf16": 1.7e-3, "real.token_kl_stderr.bf16": 5e-5,
        "real.token_kl.fp16": 2.7e-5, "real.token_kl_stderr.fp16": 2e-6, "real.accumulation.shown": True,
        "real.accumulation.contradicted": False}
RATIO = {"real.ratio.bf16_over_fp16": 63.0, "real.ratio.bf16_over_fp16_low": 50.0,
         "real.ratio.bf16_over_fp16_high": 76.0, "real.seq_kl_1k.bf16": 1.75}


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
    for figure in ("chain.svg", "decide.svg"):
        assert (tmp_path / "site" / findings.FIGURES / figure).is_file()


def test_the_mismatch_links_follow_the_real_models_numbers(tmp_path):
    _write(tmp_path, "04b_real_mismatch", REAL)
    links = findings.chain(tmp_path)
    assert [status for _, status, _ in links[:2]] == [findings.SHOWN_LINK, findings.SHOWN_LINK]
    _write(tmp_path, "04b_real_mismatch", REAL | {"real.token_kl.bf16": 2.9e-5, "real.accumulation.shown": False})
    links = findings.chain(tmp_path)  # within 3 standard errors of fp16, and a drift the fit cannot settle
    assert [status for _, status, _ in links[:2]] == [findings.UNRESOLVED, findings.UNRESOLVED]


def test_a_finding_quotes_this_builds_numbers(tmp_path):
    _write(tmp_path, "04b_real_mismatch", REAL | RATIO)
    text = findings.page(tmp_path, tmp_path / "site")
    assert "63× (95% interval 50–76)" in text


@pytest.mark.parametrize("settled, said, not_said", [
    (True, "It accumulates with the response's length", "unresolved here"),
    (False, "unresolved here", "It accumulates")])
def test_the_bf16_card_says_accumulating_only_where_the_chain_shows_it(tmp_path, settled, said, not_said):
    _write(tmp_path, "04b_real_mismatch", REAL | RATIO | {"real.accumulation.shown": settled})
    card = _card(findings.page(tmp_path, tmp_path / "site"), "bf16")
    assert said in card and not_said not in card
    # the correction is others' recommendation, named as theirs
    assert "Qi et al. 2025" in card and "Yao et al." in card


@pytest.mark.parametrize("ratio, low, high, word", [
    (1.24, 1.14, 1.34, "a little more than"), (25.0, 14.0, 40.0, "far more than"),
    (4.0, 3.0, 5.5, "more than"), (1.0, 0.9, 1.1, "about the same as"), (0.5, 0.3, 0.8, "less than")])
def test_the_lora_cards_comparative_word_comes_from_the_real_models_interval(tmp_path, ratio, low, high, word):
    _write(tmp_path, "07_lora", {"real.serving.ratio.bf16_unmerged_over_matched": ratio,
                                 "real.serving.ratio.low": low, "real.serving.ratio.high": high,
                                 "serving.ratio.bf16_unmerged_over_matched": 2018.0})
    card = _card(findings.page(tmp_path, tmp_path / "site"), "lora")
    assert f"trainer {word} matched engines do" in card
    assert "on the toy model 2018×" in card  # the toy's number only beside the real one, labelled
    if word != "far more than":
        assert "far more" not in card


def test_a_toy_metric_is_never_read_where_the_chapter_records_a_real_one(tmp_path):
    runs = {"07_lora": {"metrics": {"serving.ratio.x": 2000.0, "real.serving.ratio.x": 1.2}},
            "04_mismatch": {"metrics": {"grid.bf16_fp32.token_kl": 2e-3}},
            "04b_real_mismatch": {"metrics": {"real.token_kl.bf16_train_fp32_infer": 1.2e-3}}}
    read = findings.Reader(runs)
    with pytest.raises(findings.ToyWhereReal):
        read("07_lora:serving.ratio.x")  # the same key under real.
    with pytest.raises(findings.ToyWhereReal):
        read("04_mismatch:grid.bf16_fp32.token_kl")  # a counterpart by another name
    assert read.toy("07_lora:serving.ratio.x") == 2000.0  # shown beside the real one, labelled
    assert read("07_lora:real.serving.ratio.x") == 1.2


def test_with_every_real_counterpart_recorded_the_page_reads_only_real_numbers(tmp_path):
    # every toy metric the page knows a counterpart of, and its counterpart, in one build
    for toy, real in quantities.REAL_OF.items():
        for ref, value in ((toy, 1e-5), (real, 2e-3)):
            chapter, key = ref.split(":", 1)
            _write(tmp_path, chapter, {key: value})
    _write(tmp_path, "05b_sampler_precision", {"dial.bf16.token_kl": 1e-5, "real.dial.bf16.token_kl": 2e-3,
                                               "dial.fp8_e4m3.token_kl": 1e-4, "real.dial.fp8_e4m3.token_kl": 5e-2})
    runs = findings.load_all(tmp_path / "_build" / "results")
    read = findings.Reader(runs)
    table = findings.stacks_table(read)
    assert "1e-5" not in table.split("\n")[2].split("|")[2]  # the real column holds the real number
    assert "2.0e-3" in table and "1.0e-5" in table  # and the toy's stands beside it
    assert all(findings.real_counterpart(ref, runs) is None for ref in read.read)
    findings.page(tmp_path, tmp_path / "site")  # raises ToyWhereReal on any toy read with a real counterpart


def test_the_stack_that_is_trl_with_vllm_reads_chapter_5s_real_probe(tmp_path):
    _write(tmp_path, "05_grpo_precision", {"real.rl.long.bf16_bf16.probe_kl_start": 2.5e-3,
                                           "combo.bf16_bf16.mean_kl": 1.2e-5})
    row = next(line for line in findings.stacks_table(findings.Reader(findings.load_all(
        tmp_path / "_build" / "results"))).split("\n") if line.startswith("| trl with vLLM"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["2.5e-3", "1.2e-5"]


@pytest.mark.parametrize("gap, noise, badge", [(0.034, 0.069, "{bdg-warning}`inconclusive`"),
                                               (-0.2, 0.05, "{bdg-info}`mechanism only`")])
def test_the_fix_comparisons_badge_follows_its_interval(tmp_path, gap, noise, badge):
    _write(tmp_path, "05b_sampler_precision", {"decisive.bf16_gap": gap, "decisive.bf16_noise": noise})
    line = next(line for line in _card(findings.page(tmp_path, tmp_path / "site"), "bf16").split("\n")
                if "pre-registered fix comparison" in line)
    assert line.startswith(f"* {badge}")


def test_small_shares_are_not_rounded_to_zero():
    assert findings._pct(1e-4) == "0.01%"
    assert findings._pct(0.0075) == "0.75%"
    assert findings._pct(0.123) == "12.3%"
    assert findings._pct(0) == "0%"


def test_the_fp8_card_reads_its_sizes_and_the_lower_gradient_error(tmp_path):
    _write(tmp_path, "05b_sampler_precision", {
        "real.dial.ratio.fp8_over_bf16.value": 41.0, "real.dial.ratio.fp8_over_bf16.low": 19.0,
        "real.dial.ratio.fp8_over_bf16.high": 87.0, "real.dial.sequences": 4, "real.dial.length": 32})
    _write(tmp_path, "09_fp8", {"qerr.gradients.e4m3fn.tensor": 0.026, "qerr.gradients.e5m2.tensor": 0.053})
    card = _card(findings.page(tmp_path, tmp_path / "site"), "fp8")
    assert "4 sequences × 32 tokens = 128 tokens" in card and "an order of magnitude" in card
    assert "far larger than bf16's" in card  # 19× at the interval's low end
    assert "E4M3's error was the lower on the lab model's gradients" in card
    assert "arxiv.org/abs/2412.19437" in card


def test_every_config_line_fits_the_column(tmp_path):
    context = findings.Context(findings.Reader({}), {}, findings.installed_defaults(), ROOT)
    for key, blocks in findings.config_blocks(context).items():
        for tool, code in blocks:
            for line in code.split("\n"):
                assert len(line) <= findings.CODE_WIDTH, (key, tool, line)


def test_the_decision_figures_text_is_readable_at_the_columns_width(tmp_path):
    svg = findings.decision_figure(tmp_path / "decide.svg").read_text()
    width = float(re.search(r'viewBox="0 0 ([\d.]+) ', svg).group(1))
    assert width <= 700  # shown at the content column's width (about 690 px at 1,280), or scaled up
    assert float(re.search(r'font-size="([\d.]+)"', svg).group(1)) * 680 / width >= 11
    assert all(f"card {n}" in svg for n in {findings.CARD[card] for _, answers in findings.DECISIONS
                                             for _, _, card in answers if card})


def test_the_logs_section_names_what_the_installed_trl_logs():
    names, version = findings.trl_logged()
    assert {"sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/max"} <= set(names)


def test_the_paper_precision_rl_and_each_framework_are_linked(tmp_path):
    text = findings.page(tmp_path, tmp_path / "site")
    assert "(https://arxiv.org/abs/2510.26788)" in text and "(https://github.com/sail-sg/Precision-RL)" in text
    for url in findings.FRAMEWORKS.values():
        assert text.count(f"]({url})") == 1, url


DIRECTION = {"direction.at_paper.label": "3-bit mantissa (emulated)", "direction.at_paper.dose": 1.9,
             "direction.at_paper.rho": 0.9, "direction.at_paper.rho_se": 0.2, "direction.at_paper.power": 0.1,
             "direction.completions_for_80": 20000, "direction.verdict.restored": "unresolved",
             "direction.at_paper.default_change": 0.01, "direction.at_paper.default_change_se": 0.02,
             "direction.at_paper.tis_change": 0.0, "direction.at_paper.tis_change_se": 0.01,
             "direction.first_lost.label": "none"}


@pytest.mark.parametrize("verdict, status", [("shown", findings.SHOWN_LINK), ("contradicted", findings.AGAINST),
                                             ("unresolved", findings.UNRESOLVED)])
def test_the_update_link_reads_the_update_direction_chapters_verdict(tmp_path, verdict, status):
    _write(tmp_path, "05c_update_direction", DIRECTION | {"direction.verdict.biased": verdict})
    links = {text: s for text, s, _ in findings.chain(tmp_path)}
    assert links["GRPO on mismatched samples computes a biased update (it loses the on-policy direction)"] == status
    page = findings.page(tmp_path, tmp_path / "site")
    if verdict == "unresolved":  # an unresolved link states its power and what would decide it
        assert "power 10%; about 20,000 completions per sampler would give 80% power" in page


def test_the_quoted_trl_defaults_are_the_installed_ones():
    from trl import GRPOConfig

    defaults = findings.installed_defaults()
    assert defaults["trl_is_mode"] == str(GRPOConfig.__dataclass_fields__["vllm_importance_sampling_mode"].default)
    assert defaults["trl_is_clip"] == str(GRPOConfig.__dataclass_fields__["vllm_importance_sampling_clip_max"].default)


def test_this_builds_page_reads_no_toy_number_where_a_real_one_is_recorded(tmp_path):
    runs = findings.load_all(ROOT / "_build" / "results")
    if not runs:
        pytest.skip("no results in this checkout's build")
    findings.page(ROOT, tmp_path / "site")  # raises ToyWhereReal where the page would


def test_the_chain_figure_is_narrow_enough_to_show_its_text_at_full_size(tmp_path):
    links = [(text, findings.UNRESOLVED, "05b_sampler_precision") for text in "abcde"]
    svg = findings.chain_figure(links, tmp_path / "chain.svg").read_text()
    width_pt = float(re.search(r'<svg[^>]* width="([\d.]+)pt"', svg).group(1))
    assert width_pt * 96 / 72 <= 690  # shown at its natural size in the column: 12-point text stays 16 px
