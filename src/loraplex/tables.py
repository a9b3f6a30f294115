"""Tables printed by the CLIs: rich's boxes on a terminal; piped, tab-separated lines with every
value whole, for grep, cut and awk."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table


def is_piped() -> bool:
    """Whether standard output is not a terminal (a pipe, a file)."""
    return not sys.stdout.isatty()


def print_table(table: Table) -> None:
    """On a terminal, the table as rich draws it; piped, `# TITLE`, then the headers and one line
    per row, the cells separated by tabs and never cut (a tab or newline in a cell becomes a
    space)."""
    if not is_piped():
        Console().print(table)
        return
    if table.title:
        print(f"# {table.title}")
    columns = [[_plain(c.header)] + [_plain(cell) for cell in c.cells] for c in table.columns]
    for row in zip(*columns, strict=True):
        print("\t".join(row))


def print_line(text: str) -> None:
    """A line of rich markup: styled on a terminal, plain and never wrapped when piped."""
    Console(soft_wrap=True).print(text)


def _plain(cell) -> str:
    text = cell.plain if hasattr(cell, "plain") else str(cell)
    return " ".join(text.replace("\t", " ").splitlines())
