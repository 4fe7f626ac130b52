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


@pytest.mark.parametrize("stem", CHAPTERS)
def test_each_chapter_opens_with_its_answer_and_keeps_its_bookkeeping_out_of_sight(stem):
    measured = anatomy.measure((layout.ROOT / "chapters" / f"{stem}.md").read_text())
    assert measured.opening_box, f"{stem} has no opening box"
    assert measured.words <= anatomy.WORDS_AT_MOST, (stem, measured.words)
    assert measured.bookkeeping_share <= anatomy.BOOKKEEPING_AT_MOST, (stem, measured)
    assert measured.widest_line <= anatomy.WIDTH_AT_MOST, (stem, measured.widest_line)
