"""Markdown tables for the tooling's reports.

Written here rather than with a library: tabulate (what pandas' `to_markdown` calls) is not installed with the
`[eval]` extra's dependencies, and pipe tables of pre-formatted cells need nothing more than these lines."""

from __future__ import annotations

from typing import Iterable, List, Sequence


def table(header: Sequence[str], rows: Iterable[Sequence], align: str = "---") -> List[str]:
    """Lines of a pipe table: the header, the separator (`align` in every column: "---", "---:"), one line per row
    (cells formatted with str)."""
    lines = [_row(header), _row([align] * len(header))]
    lines += [_row(row) for row in rows]
    return lines


def _row(cells: Sequence) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"
