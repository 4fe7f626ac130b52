"""The pipeline's own rules, on a two-cell chapter in a scratch project (a few seconds of papermill)."""
import json
import os

import pytest

from bookbuild import pipeline, warm

CHAPTER = """---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---

# Tiny

```{{code-cell}} ipython3
:tags: [parameters]

profile = "cpu"
value = 1
```

```{{code-cell}} ipython3
:tags: [{tags}]

{body}
```

```{{code-cell}} ipython3
from labutils import results

run = results.ChapterRun("zz_tiny", profile)
run.record(value=value)
run.save();
```
"""


def _project(tmp_path, tags="raises-exception, error-required", body="raise ValueError('meant')"):
    (tmp_path / "chapters").mkdir(exist_ok=True)
    (tmp_path / "_toc.yml").write_text("root: intro\nchapters:\n  - file: chapters/zz_tiny\n")
    (tmp_path / "chapters" / "zz_tiny.md").write_text(CHAPTER.format(tags=tags, body=body))
    return tmp_path


@pytest.fixture(scope="module", autouse=True)
def _warm_kernels():
    """Kernels forked from a warm server that imported torch, as `execute_all` starts them."""
    with warm.server(dict(os.environ, OMP_NUM_THREADS="1"), libraries=("torch",)) as path:
        assert path, "the warm server refused to serve"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(warm.SOCKET, path)
            yield


def test_the_kernel_is_forked_from_the_warm_server(tmp_path, monkeypatch):
    body = "import sys\nvalue = 'torch' in sys.modules  # imported by nothing this kernel ran so far"
    root = _project(tmp_path, tags="hide-output", body=body)
    pipeline.execute("zz_tiny", "cpu", root=root)
    assert json.loads((root / "_build" / "results" / "zz_tiny.json").read_text())["metrics"]["value"] is True
    monkeypatch.delenv(warm.SOCKET)
    pipeline.execute("zz_tiny", "cpu", root=root, force=True)  # without a server: a fresh kernel
    assert json.loads((root / "_build" / "results" / "zz_tiny.json").read_text())["metrics"]["value"] is False


@pytest.fixture(autouse=True)
def _restore_results_dir():
    """`execute` points LAB_RESULTS_DIR at the project it runs; put it back for the other tests."""
    import os

    before = os.environ.pop("LAB_RESULTS_DIR", None)
    yield
    os.environ.pop("LAB_RESULTS_DIR", None)
    if before is not None:
        os.environ["LAB_RESULTS_DIR"] = before


def test_unchanged_chapters_are_skipped_and_foreign_results_are_not_trusted(tmp_path, capsys):
    root = _project(tmp_path)
    pipeline.execute("zz_tiny", "cpu", root=root)
    results_file = root / "_build" / "results" / "zz_tiny.json"
    data = json.loads(results_file.read_text())
    assert data["metrics"]["value"] == 1
    assert data["fingerprint"] == pipeline.fingerprint("zz_tiny", {"profile": "cpu"}, root)
    pipeline.execute("zz_tiny", "cpu", root=root)
    assert "unchanged, not executed again" in capsys.readouterr().out
    # a run with other parameters, written over the book's results by hand, is not published
    data.update(fingerprint=None, metrics={"value": 7})
    results_file.write_text(json.dumps(data))
    pipeline.execute("zz_tiny", "cpu", root=root)
    assert "executed in" in capsys.readouterr().out
    assert json.loads(results_file.read_text())["metrics"]["value"] == 1
    pipeline.execute("zz_tiny", "cpu", parameters={"value": 3}, root=root)  # new parameters: executed again
    assert json.loads(results_file.read_text())["metrics"]["value"] == 3


def test_a_cell_required_to_fail_that_does_not_fail_stops_the_build(tmp_path):
    root = _project(tmp_path, body="print('no error here')")
    with pytest.raises(pipeline.ChapterError, match="error-required but raised nothing on cpu"):
        pipeline.execute("zz_tiny", "cpu", root=root)


def test_an_error_required_only_on_cuda_may_pass_on_the_cpu(tmp_path):
    root = _project(tmp_path, tags="raises-exception, error-required-cuda", body="print('fine on the cpu')")
    pipeline.execute("zz_tiny", "cpu", root=root)


def test_an_untagged_error_fails_with_the_cell_named(tmp_path):
    root = _project(tmp_path, tags="hide-output", body="raise KeyError('unexpected')")
    with pytest.raises(pipeline.ChapterError, match="not tagged raises-exception failed with KeyError"):
        pipeline.execute("zz_tiny", "cpu", root=root)


def test_a_participants_runs_leave_the_books_results_untouched(tmp_path, capsys):
    import os

    import jupytext
    import papermill

    root = _project(tmp_path, tags="hide-output", body="pass")
    pipeline.execute("zz_tiny", "cpu", root=root)
    book = root / "_build" / "results" / "zz_tiny.json"
    published = book.read_text()
    own = pipeline.own_build("ana", root)  # `pipeline run zz_tiny -p value=5 --participant ana`
    pipeline.execute("zz_tiny", "cpu", parameters={"value": 5}, force=True, root=root, build=own)
    assert json.loads((own / "results" / "zz_tiny.json").read_text())["metrics"]["value"] == 5
    os.environ.pop("LAB_RESULTS_DIR")  # by hand, from the project's root, as the README once showed
    plain = tmp_path / "zz_tiny.ipynb"
    jupytext.write(jupytext.read(root / "chapters" / "zz_tiny.md"), plain)
    papermill.execute_notebook(str(plain), str(tmp_path / "out.ipynb"), parameters={"value": 9}, cwd=str(root),
                               progress_bar=False)
    assert json.loads((root / "_build" / "runs" / "mine" / "results" / "zz_tiny.json").read_text())["metrics"]["value"] == 9
    assert book.read_text() == published
    pipeline.execute("zz_tiny", "cpu", root=root)
    assert "unchanged, not executed again" in capsys.readouterr().out
    for name in ("../book", "..", ".", "a/b"):
        with pytest.raises(ValueError, match="not a folder name"):
            pipeline.own_build(name, root)


def test_participant_parameters_are_read_as_literals():
    assert pipeline._parameter("seed=1") == ("seed", 1) and pipeline._parameter("model_id=/tmp/m") == ("model_id", "/tmp/m")
    with pytest.raises(Exception, match="key=value"):
        pipeline._parameter("seed")


def test_execute_all_names_the_failed_chapter_and_its_error(tmp_path):
    root = _project(tmp_path, tags="hide-output", body="raise KeyError('unexpected')")
    with pytest.raises(pipeline.ChapterError, match=r"zz_tiny: .*ChapterError: zz_tiny.ipynb: a cell not tagged"):
        pipeline.execute_all(["zz_tiny"], "cpu", jobs=2, root=root, warm_start=False)  # the module's server serves


def test_executed_notebooks_show_no_machine_paths(tmp_path):
    import nbformat

    root = _project(tmp_path, body="import torch.amp.grad_scaler as g\nraise ValueError(g.__file__)")
    executed = pipeline.execute("zz_tiny", "cpu", root=root)
    notebook = nbformat.reads(executed.read_text(), as_version=4)
    error = next(o for c in notebook.cells for o in c.get("outputs", []) if o.output_type == "error")
    shown = "\n".join(error.traceback)
    assert "<site-packages>/torch/amp/grad_scaler.py" in shown and str(tmp_path) not in shown


def test_the_fingerprint_covers_library_versions_and_the_kernel_set(monkeypatch):
    """After an upgrade, or on another CPU, a chapter's old results are executed again, never published."""
    key = pipeline.fingerprint("01_number_formats", {"profile": "cpu"})
    here = pipeline.environment()
    assert here["libraries"]["torch"] and here["kernels"].startswith("aten ")
    for changed in ({**here, "libraries": {**here["libraries"], "trl": "0.0.1"}},
                    {**here, "kernels": here["kernels"].replace("onednn max default", "onednn max AVX2")}):
        monkeypatch.setattr(pipeline, "environment", lambda changed=changed: changed)
        assert pipeline.fingerprint("01_number_formats", {"profile": "cpu"}) != key


def test_a_new_committed_long_run_executes_the_chapters_again(tmp_path):
    """A chapter that reads a committed run shows that run's numbers, never the previous one's."""
    (tmp_path / "chapters").mkdir()
    (tmp_path / "chapters" / "zz.md").write_text("# zz\n")
    (tmp_path / "labutils").mkdir()
    (tmp_path / "results" / "long").mkdir(parents=True)
    run = tmp_path / "results" / "long" / "real_rl.json"
    run.write_text('{"minutes": 81.7}')
    key = pipeline.fingerprint("zz", {"profile": "cpu"}, tmp_path)
    run.write_text('{"minutes": 18.1}')
    assert pipeline.fingerprint("zz", {"profile": "cpu"}, tmp_path) != key
