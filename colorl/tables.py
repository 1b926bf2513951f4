"""Tables that fit the screen: a table wider than the console is printed as several, each with the first
column repeated, so that an 80-column terminal, a pipe or CI shows every figure whole (rich would squeeze
the columns into "…")."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

PADDING = 3  # rich's cell padding and border, per column


def column_groups(headers: list[str], rows: list[list[str]], width: int) -> list[list[int]]:
    """The indices of the columns after the first, in groups that fit `width` beside the first column."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) + PADDING for i, h in enumerate(headers)]
    room = max(width - widths[0] - 1, 1)
    groups: list[list[int]] = [[]]
    used = 0
    for i in range(1, len(headers)):
        if groups[-1] and used + widths[i] > room:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += widths[i]
    return groups


def print_table(console: Console, title: str, headers: list[str], rows: list[list[str]],
                row_styles: list[str | None] | None = None) -> None:
    """Right-aligned figures under `headers`; the first column (names, steps) on the left, in every part."""
    groups = column_groups(headers, rows, console.width)
    for part, group in enumerate(groups, 1):
        suffix = f" ({part}/{len(groups)})" if len(groups) > 1 else ""
        table = Table(title=f"{title}{suffix}", title_justify="left")
        table.add_column(headers[0], no_wrap=True)
        for i in group:
            table.add_column(headers[i], justify="right", no_wrap=True)
        for r, row in enumerate(rows):
            table.add_row(row[0], *(row[i] for i in group), style=(row_styles or [None] * len(rows))[r])
        console.print(table)
