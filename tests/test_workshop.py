"""The workshop page is a teaching plan built from this build's chapters and results."""
import json

from bookbuild import pipeline, workshop, workshop_check, workshop_speed


def test_the_plan_fits_three_hours_with_the_exercises_inside_the_blocks():
    assert sum(block.minutes for block in workshop.PLAN) <= workshop.SLOT
    for block in workshop.PLAN:
        assert all(0 < e.minutes <= block.minutes for e in block.exercises), block.name
        assert workshop.exercise_minutes(block) <= block.minutes, block.name
    assert "A block's minutes include its exercises" in workshop.page(pipeline.ROOT)


def test_every_block_with_chapters_has_objectives_exercises_misconceptions_and_prompts():
    page = workshop.page(pipeline.ROOT)
    for block in workshop.PLAN:
        if block.chapters:
            assert block.objectives and block.prerequisites and block.exercises, block.name
            assert block.misconceptions and 2 <= len(block.prompts) <= 3, block.name
            assert f"### {block.name}" in page
        for e in block.exercises:
            assert e.stem in pipeline.chapters() and e.workload in workshop_speed.SHAPES
            title = workshop._exercise_title(pipeline.ROOT, e.stem, e.number)
            assert title != f"exercise {e.number}" and title.rstrip(".") in page  # the chapter has that exercise
            # the cell whose time is the exercise's run is in the chapter's Exercises section
            source = (pipeline.ROOT / "chapters" / f"{e.stem}.md").read_text()
            assert e.cell in source.split("## Exercises", 1)[1], (e.stem, e.number)
            for first in e.needs or ():
                assert f"\n{first}" in source, (e.stem, first)  # a cell of the chapter begins with it


def test_cell_times_come_from_papermills_record_of_each_cell(tmp_path):
    import nbformat

    cells = [nbformat.v4.new_code_cell(src) for src in
             ("setup()", "long()", "crash = build()", "# exercise 1: the run", "after()")]
    for cell, took in zip(cells, (1.5, 30.0, 2.0, 4.0, 9.0)):
        cell.metadata["papermill"] = {"duration": took}
    section = nbformat.v4.new_markdown_cell("## The first section")
    (tmp_path / "_build" / "executed").mkdir(parents=True)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# T"), cells[0], section,
                                                   *cells[1:]]),
                   tmp_path / "_build" / "executed" / "09_demo.ipynb")
    every_cell_above = workshop.Exercise("09_demo", 1, 10, "toy", "# exercise 1: the run")
    assert workshop.cell_seconds(tmp_path, every_cell_above) == (33.5, 4.0)
    needed = workshop.Exercise("09_demo", 1, 10, "toy", "# exercise 1: the run", needs=("crash = ",), runs=2)
    assert workshop.cell_seconds(tmp_path, needed) == (3.5, 2.0)  # the set-up cell and the one it needs
    assert workshop.cell_seconds(tmp_path, workshop.Exercise("09_demo", 2, 10, "toy", "# exercise 2")) is None
    assert workshop.cell_seconds(tmp_path, workshop.Exercise("09_demo", 1, 10, "toy", "# exercise 1",
                                                             needs=("missing()",))) is None


def test_the_check_scales_each_run_by_its_workloads_ratio_and_keeps_the_thinking_time():
    reference = {"seconds": {f"{s}.{d}": 1.0 for s in workshop_speed.SHAPES for d in workshop_speed.DTYPES}}
    here = {"seconds": {**{k: 2.0 for k in reference["seconds"]}, "real.bfloat16": 8.0}}
    scale = workshop_speed.ratios(here, reference)
    assert scale == {"toy": (2.0, 2.0), "real": (2.0, 8.0)}
    rows = [{"label": "01 exercise 1", "block": "B", "minutes": 10, "workload": "toy", "own_seconds": 60.0,
             "first_seconds": 30.0},
            {"label": "02 exercise 1", "block": "B", "minutes": 10, "workload": "real", "own_seconds": 60.0,
             "first_seconds": 30.0},
            {"label": "03 exercise 1", "block": "B", "minutes": 10, "workload": "toy", "own_seconds": None,
             "first_seconds": None}]
    toy, real, missing = workshop_speed.expected_minutes(rows, scale)
    assert "11 min" in toy and "1.0–4.0 min" in toy  # 9 + 1·2 min of run; 0.5 min above it, 2 to 8 times
    assert "11–17 min" in real
    assert "not in the build" in missing


def test_bitsandbytes_platforms_are_read_from_its_own_accelerator_table():
    readme = """<table><tbody>
    <tr><td colspan="6">🐧 <strong>Linux, glibc >= 2.24</strong></td></tr>
    <tr><td align="right">x86-64</td><td>◻️ CPU</td><td>Minimum: AVX2<br>Optimized: AVX512F</td>
        <td>✅</td><td>✅</td><td>✅</td></tr>
    <tr><td></td><td>🟩 NVIDIA GPU <br><code>cuda</code></td><td>SM60+</td><td>✅</td><td>✅</td><td>✅</td></tr>
    <tr><td colspan="6">🍎 <strong>macOS 14+</strong></td></tr>
    <tr><td align="right">arm64</td><td>◻️ CPU</td><td>Apple M1+</td><td>✅ *</td><td>✅</td><td>✅</td></tr>
    <tr><td colspan="6">🪟 <strong>Windows 11</strong></td></tr>
    <tr><td align="right">x86-64</td><td>◻️ CPU</td><td>AVX2</td><td>✅</td><td>❌</td><td>✅</td></tr>
    </tbody></table>"""
    assert workshop.cpu_4bit_platforms(readme) == ["Linux, glibc >= 2.24 x86-64 (Minimum: AVX2, Optimized: AVX512F)",
                                                   "macOS 14+ arm64 (Apple M1+)"]


def test_the_teachers_notes_read_each_range_from_the_chapters_records(tmp_path):
    (tmp_path / "_build" / "results").mkdir(parents=True)
    (tmp_path / "_build" / "results" / "04_mismatch.json").write_text(json.dumps(
        {"chapter": "04_mismatch", "metrics": {"exercise": {"temperature_07": {
            "paired_ratio": 0.79, "paired_low": 0.41, "paired_high": 1.54}}}}))
    notes = "\n".join(workshop.teachers(tmp_path))
    assert "near 0.79, anywhere in 0.41–1.54" in notes
    assert "not in this build" in notes  # the chapters this folder has no results for
    for block in workshop.PLAN:
        for prompt in block.prompts:
            assert prompt in notes


def test_the_build_records_the_speed_reference_once_per_executed_build(tmp_path, monkeypatch):
    timed = []

    def fake_record(path, threads=1):
        timed.append(path)
        data = {"seconds": {"toy.float32": 0.01}, "threads": threads, "cpu": "test CPU"}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
        return data

    monkeypatch.setattr(workshop_speed, "record_reference", fake_record)
    monkeypatch.setattr(workshop, "footprint", lambda: {"environment_bytes": 2})
    (tmp_path / "_build" / "results").mkdir(parents=True)
    first = workshop.reference(tmp_path)
    assert first["footprint"] == {"environment_bytes": 2} and "exercises" in first
    workshop.reference(tmp_path)
    assert len(timed) == 1  # no chapter ran since: the timing is kept


def test_the_crash_block_quotes_the_gpu_error_only_from_a_committed_run(tmp_path):
    assert "No GPU reference run of chapter 2" in "\n".join(workshop._crash_on_gpu(tmp_path))
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "gpu" / "02_qlora_crash.json").write_text(json.dumps(
        {"chapter": "02_qlora_crash", "env": {"device_name": "NVIDIA H200"},
         "metrics": {"crash.error": "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'"},
         "provenance": {"gpu": "NVIDIA H200"}}))
    shown = "\n".join(workshop._crash_on_gpu(tmp_path))
    assert "NVIDIA H200" in shown and "not implemented for 'BFloat16'" in shown


def test_the_workload_times_every_shape_and_dtype():
    timed = workshop_speed.workload(threads=1, budget=0.05)
    assert set(timed["seconds"]) == {f"{s}.{d}" for s in workshop_speed.SHAPES for d in workshop_speed.DTYPES}
    assert all(v > 0 for v in timed["seconds"].values()) and timed["threads"] == 1


def test_jupyter_lab_opens_a_chapters_source_as_a_notebook():
    """The participants' interactive path: `jupyter lab`, jupytext pairing the Markdown source with a notebook."""
    assert "opens as a notebook of" in workshop_check.interactive("01_number_formats")
