"""Plain-text tables for the command line."""
from __future__ import annotations

from typing import Sequence

import pandas as pd


def format_table(rows: Sequence[dict] | pd.DataFrame, columns: Sequence[str], formats: dict | None = None) -> str:
    """Render ``rows`` (dicts, or a DataFrame's rows) as an aligned text table of ``columns``.

    ``formats`` maps a column to a format spec such as ``".3f"``; other values use ``str``.
    """
    formats = formats or {}
    if isinstance(rows, pd.DataFrame):
        rows = rows.to_dict("records")

    def cell(row: dict, column: str) -> str:
        value = row.get(column, "")
        spec = formats.get(column)
        return format(value, spec) if spec and isinstance(value, (int, float)) else str(value)

    cells = [[cell(row, c) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join([line, rule, *body])
