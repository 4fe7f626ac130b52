"""Measured tables: pandas Stylers that render as plain HTML tables in Jupyter and in the built book."""
from __future__ import annotations

import html
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence

import pandas as pd
from pandas.io.formats.style import Styler

Format = str | Callable[[object], str]
DEFAULT_FORMAT = "{:.4g}"  # fixed for ordinary values, scientific below 1e-4 and from 1e4 up


def power_of_two(value: float) -> str:
    """A positive number as `2^k` (loss scales)."""
    return f"2^{math.log2(value):.0f}"


def frame(rows: Mapping | Sequence, columns: Sequence[str] | None = None) -> pd.DataFrame:
    """A DataFrame of `rows`: a dict of name -> value (two columns), or one dict or sequence per row."""
    if isinstance(rows, Mapping):
        rows, columns = list(rows.items()), list(columns or ("name", "value"))
    rows = list(rows)
    if rows and isinstance(rows[0], Mapping):
        columns = list(columns or rows[0])
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping) or set(row) != set(columns):
                raise ValueError(f"row {i} has the columns {_names(row)}, but the table has {_names(columns)}.")
        rows = [[row[c] for c in columns] for row in rows]
    if columns is None:
        raise ValueError("rows given as sequences need `columns` to name them.")
    for i, row in enumerate(rows):
        if isinstance(row, Mapping) or len(row) != len(columns):
            raise ValueError(f"row {i} has {len(row)} value{'s' * (len(row) != 1)}, but the table has "
                             f"{len(columns)} columns ({_names(columns)}).")
    return pd.DataFrame([list(row) for row in rows], columns=list(columns), dtype=object)  # cells keep their types


def _names(names) -> str:
    return ", ".join(map(str, names))


def _text(value: str) -> str:
    # escaped, but `code` spans stay code, as in the chapters' prose
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(value, quote=False))


def _cell(fmt: Format | None) -> Callable[[object], str]:
    def render(value) -> str:
        if value is None:
            return "–"
        if callable(fmt):
            return _text(fmt(value))
        if isinstance(value, numbers.Number) and not isinstance(value, bool):
            return (fmt or ("{}" if isinstance(value, numbers.Integral) else DEFAULT_FORMAT)).format(value)
        return _text(str(value))
    return render


def show(rows: Mapping | Sequence, columns: Sequence[str] | None = None,
         formats: Format | Mapping[str, Format] | None = None, caption: str | None = None) -> Styler:
    """An HTML table of `rows` (as in `frame`): numbers by `formats` (one, or per column) or to 4 digits, None as –."""
    data = frame(rows, columns)
    per_column = formats if isinstance(formats, Mapping) else dict.fromkeys(data.columns, formats)
    unknown = set(per_column) - set(data.columns)
    if unknown:
        raise ValueError(f"formats name columns the table does not have: {_names(sorted(unknown))}.")
    styler = (Styler(data, cell_ids=False).hide(axis="index")  # row numbers mean nothing here
              .set_table_attributes('class="dataframe"')  # the book theme's table style
              .format({c: _cell(per_column.get(c)) for c in data.columns})
              .format_index(lambda c: _text(str(c)), axis=1))
    return styler.set_caption(_text(caption)) if caption else styler
