"""The teacher's page: solutions cut from the chapters' pages, with each chapter's glued numbers filled in."""
import nbformat
import pytest

from bookbuild import solutions

CHAPTER = """# A chapter

## Exercises

1. **Predict.** How large is eps?

```{admonition} Solutions
:class: dropdown

1. It is {glue:text}`eps:.3g`, stored as {glue:text}`name`; see {doc}`01_number_formats`.
```

## What's next
"""


def _notebook(markdown: str, glued: dict) -> nbformat.NotebookNode:
    code = nbformat.v4.new_code_cell("glue(...)")
    prefix = "application/papermill.record/"  # what glue(..., display=False) writes
    code.outputs = [nbformat.v4.new_output("display_data", data={prefix + "text/plain": value},
                                           metadata={"scrapbook": {"name": name, "mime_prefix": prefix}})
                    for name, value in glued.items()]
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(markdown), code])


def test_the_participants_page_loses_the_solutions_and_the_teacher_gets_them_filled_in():
    notebook = _notebook(CHAPTER, {"eps": "0.0078125", "name": "'bfloat16'"})
    page, blocks = solutions.split(notebook)
    assert "Solutions" not in page.cells[0].source and "## What's next" in page.cells[0].source
    assert "Solutions" in notebook.cells[0].source  # the executed notebook itself is left alone
    text = solutions.page([("01_demo", solutions.title(notebook), blocks, solutions.glued(notebook))])
    assert "It is 0.00781, stored as bfloat16; see {doc}`../chapters/01_number_formats`." in text
    assert ":class: dropdown" not in text and "## A chapter" in text


def test_a_solution_quoting_a_number_the_chapter_never_glued_stops_the_build():
    notebook = _notebook(CHAPTER, {"eps": "0.0078125"})
    _, blocks = solutions.split(notebook)
    with pytest.raises(KeyError, match="name"):
        solutions.page([("01_demo", "A chapter", blocks, solutions.glued(notebook))])


def test_every_chapter_with_exercises_has_its_solutions_block():
    import jupytext

    from bookbuild import layout

    for stem in layout.chapters():
        notebook = jupytext.read(layout.ROOT / "chapters" / f"{stem}.md")
        text = "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
        if "## Exercises" in text:
            assert solutions.split(notebook)[1], f"{stem} has exercises and no solutions block"


def test_the_teachers_page_opens_with_the_workshops_teaching_notes(tmp_path):
    from bookbuild import workshop

    text = solutions.page([], workshop.teachers(tmp_path))
    assert text.index("## Teaching the workshop") < text.index("## Solutions")
    for block in workshop.PLAN:
        for belief, _ in block.misconceptions:
            assert belief in text
