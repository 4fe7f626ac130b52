"""The workshop page is a teaching plan built from this build's chapters and results."""
import json

from bookbuild import pipeline, workshop


def test_every_block_with_chapters_has_objectives_prerequisites_and_real_exercises():
    page = workshop.page(pipeline.ROOT)
    for block in workshop.PLAN:
        if block.chapters:
            assert block.objectives and block.prerequisites and block.exercises, block.name
            assert f"### {block.name}" in page
        for stem, number, minutes in block.exercises:
            assert 0 < minutes <= block.minutes
            assert stem in pipeline.chapters()
            title = workshop._exercise_title(pipeline.ROOT, stem, number)
            assert title != f"exercise {number}" and title.rstrip(".") in page  # the chapter has that exercise


def test_the_crash_block_quotes_the_gpu_error_only_from_a_committed_run(tmp_path):
    assert "No GPU reference run of chapter 2" in "\n".join(workshop._crash_on_gpu(tmp_path))
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "gpu" / "02_qlora_crash.json").write_text(json.dumps(
        {"chapter": "02_qlora_crash", "env": {"device_name": "NVIDIA H200"},
         "metrics": {"crash.error": "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'"},
         "provenance": {"gpu": "NVIDIA H200"}}))
    shown = "\n".join(workshop._crash_on_gpu(tmp_path))
    assert "NVIDIA H200" in shown and "not implemented for 'BFloat16'" in shown


def test_jupyter_lab_opens_a_chapters_source_as_a_notebook():
    """The participants' interactive path: `jupyter lab`, jupytext pairing the Markdown source with a notebook."""
    from bookbuild import workshop_check

    assert "opens as a notebook of" in workshop_check.interactive("01_number_formats")
