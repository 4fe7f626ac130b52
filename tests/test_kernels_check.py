"""bookbuild.kernels_check: which kernels, which chapters, and which metric tests."""
import ast
from pathlib import Path

from bookbuild import kernels_check

CHAPTER_TESTS = Path(__file__).with_name("test_chapters.py")


def _tests() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(CHAPTER_TESTS.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _stems_read(node: ast.FunctionDef) -> set[str]:
    """The chapters whose results a test reads through metrics_of("<stem>")."""
    return {call.args[0].value for call in ast.walk(node)
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "metrics_of"
            and call.args and isinstance(call.args[0], ast.Constant)}


def test_a_second_kernel_set_below_the_default():
    assert kernels_check.other_kernels({"amx_bf16", "avx512f"}) == {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    assert kernels_check.other_kernels({"avx512_bf16", "avx512f"}) == {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    assert kernels_check.other_kernels({"avx512f"}) == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert kernels_check.other_kernels({"avx2"}) == {"ATEN_CPU_CAPABILITY": "default"}


def test_the_real_model_chapter_is_checked_under_the_second_kernel_set():
    assert "04b_real_mismatch" in kernels_check.STEMS


def test_each_selected_test_exists_and_reads_only_the_chapters_executed_again():
    tests = _tests()
    for name in kernels_check.TEST_NAMES:
        assert name in tests, f"{name} is not a test in {CHAPTER_TESTS.name}"
        read = _stems_read(tests[name])
        assert read, f"{name} reads no chapter's results"
        # results of a chapter not executed again are missing from the second build
        assert read <= set(kernels_check.STEMS), (name, read)
    # -k matches substrings: no other test may come along with a selected name
    for name in tests:
        if name not in kernels_check.TEST_NAMES:
            assert not any(chosen in name for chosen in kernels_check.TEST_NAMES), name


def test_every_chapter_executed_again_has_its_metric_tests_run():
    tests = _tests()
    covered = set().union(*(_stems_read(tests[name]) for name in kernels_check.TEST_NAMES))
    assert covered == set(kernels_check.STEMS)
