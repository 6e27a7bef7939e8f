"""Terminal tables that fit the terminal: columns as wide as their widest cell, never fixed widths that a real value
(OUT_OF_MEMORY, a hostlist, a long reason) overflows and misaligns."""

from __future__ import annotations

import shutil
import textwrap

ELLIPSIS = "…"
MIN_LAST = 18
"""The last column is given at least this many characters (its header whole) before a squeezable column is cut."""


def terminal_width() -> int:
    """The terminal's columns ($COLUMNS first, as the shell sets it); 80 where there is no terminal (a pipe)."""
    return max(shutil.get_terminal_size((80, 24)).columns, 40)


def printable(text: str) -> str:
    """Values come from files and from Slurm, where anyone may have put an escape sequence: shown as '?'."""
    return "".join(c if c.isprintable() else "?" for c in text)


def cut(text: str, width: int) -> str:
    """`text` in at most `width` characters: whole when it fits, else its start and an ellipsis."""
    return text if len(text) <= width else text[:max(width - 1, 0)] + ELLIPSIS


def aligned(header: tuple[str, ...], rows: list[tuple[str, ...]], width: int, *, squeeze: int | None = None,
            indent: str = "") -> list[list[str]]:
    """The rows under `header`, each column as wide as its widest cell and two spaces apart; the last column wraps
    onto lines of its own under itself, so nothing of it is lost. Where the other columns leave the last fewer than
    MIN_LAST characters, the cells of column `squeeze` are cut with an ellipsis (only as far as needed). The lines of
    each row (the header's first), so that a caller may put lines of its own between rows."""
    table = [tuple(printable(cell) for cell in header)] + [tuple(printable(cell) for cell in row) for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    used = len(indent) + sum(w + 2 for w in widths)
    if squeeze is not None and width - used < MIN_LAST:
        widths[squeeze] = max(widths[squeeze] - (MIN_LAST - (width - used)), len(header[squeeze]), 4)
        used = len(indent) + sum(w + 2 for w in widths)
    last = max(width - used, 8)
    out = []
    for r in table:
        start = indent + "  ".join(cut(cell, w).ljust(w) for cell, w in zip(r, widths, strict=False)) + "  "
        parts = textwrap.wrap(r[-1], last, break_on_hyphens=False) or [""]
        out.append([(start + parts[0]).rstrip()] + [" " * used + part for part in parts[1:]])
    return out
