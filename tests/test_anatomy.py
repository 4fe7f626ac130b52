"""What a reader meets in each chapter: an opening box, bounded prose, the experiment visible, bookkeeping hidden."""
import pytest

from bookbuild import anatomy, layout

CHAPTERS = layout.chapters()


def test_the_measure_counts_what_it_says():
    source = "\n".join([
        "# Title", "", "```{admonition} In short", "Some words here.", "```", "",
        "```{code-cell} ipython3", "engine = build()  # the experiment", 'glue("x", 1, display=False)', "```", "",
        "```{code-cell} ipython3", ":tags: [remove-input]", "", 'run.record(x=1)', "```"])
    measured = anatomy.measure(source)
    assert (measured.code_lines, measured.bookkeeping_lines, measured.opening_box) == (2, 1, True)
    assert measured.words == 4  # "Title", "Some", "words", "here"


def test_the_widest_line_counts_visible_comments_and_not_the_parameters_cell():
    """A reader sees a comment in the code box, so it counts towards the widest line; the build removes the
    parameters cell from the page, so its lines count for nothing."""
    comment = "# " + "c" * 95
    source = "\n".join([
        "```{code-cell} ipython3", ":tags: [parameters]", "", 'profile = "auto"  # ' + "p" * 100, "```", "",
        "```{code-cell} ipython3", comment, "x = 1", "```"])
    measured = anatomy.measure(source)
    assert (measured.code_lines, measured.widest_line) == (1, len(comment))


@pytest.mark.parametrize("stem", CHAPTERS)
def test_each_chapter_opens_with_its_answer_and_keeps_its_bookkeeping_out_of_sight(stem):
    measured = anatomy.measure((layout.ROOT / "chapters" / f"{stem}.md").read_text())
    assert measured.opening_box, f"{stem} has no opening box"
    assert measured.words <= anatomy.WORDS_AT_MOST, (stem, measured.words)
    assert measured.bookkeeping_share <= anatomy.BOOKKEEPING_AT_MOST, (stem, measured)
    assert measured.widest_line <= anatomy.WIDTH_AT_MOST, (stem, measured.widest_line)


SHOWN = {"show", "table", "metrics_table", "provenance"}  # calls whose value is the table or text a cell displays


def discarded_tables(source: str) -> list[str]:
    """Calls that build a table for display but are not a cell's last expression, so the page never shows them."""
    import ast

    import jupytext

    found = []
    for cell in jupytext.reads(source, fmt="md:myst").cells:
        if cell.cell_type != "code" or "remove-cell" in cell.metadata.get("tags", []):
            continue
        try:
            body = ast.parse(cell.source).body
        except SyntaxError:  # IPython magics: not the book's habit, and nothing to check
            continue
        for statement in body[:-1]:
            call = statement.value if isinstance(statement, ast.Expr) else None
            if isinstance(call, ast.Call) and getattr(call.func, "attr", None) in SHOWN:
                found.append(ast.unparse(call)[:80])
    return found


def test_the_table_check_finds_a_table_that_a_later_line_hides():
    source = "```{code-cell} ipython3\ntables.show(rows)\nreadings.support('x', True)\n```\n"
    assert discarded_tables(source) == ["tables.show(rows)"]
    assert discarded_tables("```{code-cell} ipython3\nx = 1\ntables.show(rows)\n```\n") == []


@pytest.mark.parametrize("stem", CHAPTERS)
def test_every_table_a_chapter_builds_reaches_its_page(stem):
    assert discarded_tables((layout.ROOT / "chapters" / f"{stem}.md").read_text()) == []
