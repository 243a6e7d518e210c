"""Tables for the book: plain HTML, so every row is always on the page (a plotly table scrolls its rows inside
a fixed-height figure and hides the ones that do not fit)."""
from __future__ import annotations

import html
from typing import Any, List, Sequence


class Table:
    """Rows under a header, with a caption saying what was measured where. ``columns``: header cells;
    ``rows``: one sequence per row, as many cells as columns (numbers are shown as given: format them first).

    Raises ValueError when a row has the wrong number of cells."""

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = ""):
        self.columns = [str(c) for c in columns]
        self.rows: List[List[Any]] = [list(r) for r in rows]
        for i, r in enumerate(self.rows):
            if len(r) != len(self.columns):
                raise ValueError(f"row {i} has {len(r)} cells; the table has {len(self.columns)} columns "
                                 f"{self.columns}")
        self.caption = caption

    def column(self, name: str) -> list:
        """The cells of one column, top to bottom."""
        return [r[self.columns.index(name)] for r in self.rows]

    def _repr_html_(self) -> str:
        esc = lambda x: html.escape(str(x))  # noqa: E731
        cap = f"<caption>{esc(self.caption)}</caption>" if self.caption else ""
        head = "".join(f"<th>{esc(c)}</th>" for c in self.columns)
        # a column of single tokens (pattern names, "decode", "4096-65536") never breaks inside a token
        keep = [all(" " not in str(r[i]).strip() and len(str(r[i])) <= 28 for r in self.rows)
                for i in range(len(self.columns))]
        td = lambda i: '<td style="white-space: nowrap">' if keep[i] else "<td>"  # noqa: E731
        body = "".join("<tr>" + "".join(f"{td(i)}{esc(x)}</td>" for i, x in enumerate(r)) + "</tr>"
                       for r in self.rows)
        return f'<table class="sa-table">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'

    def __repr__(self) -> str:
        cells = [self.columns] + [[str(x) for x in r] for r in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in cells]
        return "\n".join(([self.caption] if self.caption else []) + lines)
