"""tables: measured values to HTML tables."""
from html.parser import HTMLParser

import pytest

from labutils import tables
from labutils.env import env_report, env_table


class Cells(HTMLParser):
    """The header cells, body rows and caption of the first table in some HTML."""

    def __init__(self, html: str):
        super().__init__()
        self.header, self.rows, self.caption, self._in = [], [], "", None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        if tag == "tr" and self._in != "th":
            self.rows.append([])
        if tag in ("th", "td", "caption"):
            self._in, self._text = tag, ""

    def handle_data(self, data):
        if self._in:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "th":
            self.header.append(self._text)
        elif tag == "td":
            self.rows[-1].append(self._text)
        elif tag == "caption":
            self.caption = self._text
        if tag in ("th", "td", "caption"):
            self._in = None


def parsed(styler) -> Cells:
    cells = Cells(styler.to_html())
    cells.rows = [r for r in cells.rows if r]  # the header's row holds no td
    return cells


def test_rows_become_an_html_table_with_formatted_numbers():
    rows = [{"precision": "bf16", "token KL": 8.1234e-7, "final reward": 0.41666, "steps": 20, "flip rate": 0.0075},
            {"precision": "fp32", "token KL": 0.0, "final reward": 0.5, "steps": 20, "flip rate": None}]
    html = tables.show(rows, formats={"token KL": "{:.2e}", "final reward": "{:.3f}", "flip rate": "{:.2%}"},
                       caption="One run per precision.").to_html()
    cells = Cells(html)
    assert "<table" in html and 'class="dataframe"' in html and "row_heading" not in html  # no index column
    assert cells.header == ["precision", "token KL", "final reward", "steps", "flip rate"]
    assert [r for r in cells.rows if r] == [["bf16", "8.12e-07", "0.417", "20", "0.75%"],
                                            ["fp32", "0.00e+00", "0.500", "20", "–"]]
    assert cells.caption == "One run per precision."


def test_default_format_is_scientific_only_for_tiny_and_huge_values():
    cells = parsed(tables.show([(1.5e-7, 0.8125, 123456.0, 3, True, float("nan"))], columns="abcdef"))
    assert cells.rows == [["1.5e-07", "0.8125", "1.235e+05", "3", "True", "nan"]]
    assert parsed(tables.show([(1.5e-7,)], columns=["a"], formats="{:.1e}")).rows == [["1.5e-07"]]


def test_a_dict_is_a_two_column_table():
    cells = parsed(tables.show({"eps.float16": 2**-10, "flag": False}, columns=["metric", "this run"]))
    assert cells.header == ["metric", "this run"]
    assert cells.rows == [["eps.float16", "0.0009766"], ["flag", "False"]]


def test_text_is_escaped_and_code_spans_stay_code():
    html = tables.show([("`fp16=True` <no scaler>",)], columns=["symptom"]).to_html()
    assert "<code>fp16=True</code> &lt;no scaler&gt;" in html


@pytest.mark.parametrize("rows, columns, message", [
    ([(1, 2), (3,)], ["a", "b"], "row 1 has 1 value, but the table has 2 columns (a, b)."),
    ([{"a": 1, "b": 2}, {"a": 3}], None, "row 1 has the columns a, but the table has a, b."),
    ([(1, 2)], None, "rows given as sequences need `columns` to name them."),
])
def test_ragged_rows_are_refused_in_one_sentence(rows, columns, message):
    with pytest.raises(ValueError) as refused:
        tables.show(rows, columns=columns)
    assert str(refused.value) == message


def test_formats_for_missing_columns_are_refused():
    with pytest.raises(ValueError, match="formats name columns the table does not have: reward."):
        tables.show([{"a": 1.0}], formats={"reward": "{:.3f}"})


def test_power_of_two():
    assert tables.power_of_two(65536.0) == "2^16" and tables.power_of_two(0.5) == "2^-1"


def test_env_table_lists_the_report():
    report = env_report()
    cells = parsed(env_table(report))
    assert cells.header == ["component", "this run"]
    assert [r[0] for r in cells.rows] == list(report) and cells.rows[1] == ["torch", report["torch"]]
