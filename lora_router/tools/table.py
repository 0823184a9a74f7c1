"""Plain-text tables for the terminal: what `--check` and `--demo` print.

Columns are padded to their widest cell; a column whose every cell looks like a number is
right-aligned. Each cell is `terminal.shown`: a name from a replica is printed literally, its
control characters escaped. Pure: returns a string, prints nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_router.tools.terminal import shown


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: int = 2) -> str:
    """`headers` and `rows` as aligned columns, with a rule under the header."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    ncols = max(len(r) for r in cells)
    for r in cells:
        r.extend("" for _ in range(ncols - len(r)))
    widths = [max(len(r[i]) for r in cells) for i in range(ncols)]
    numeric = [
        all(_looks_numeric(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(ncols)
    ]
    pad = " " * indent
    lines = []
    for n, r in enumerate(cells):
        parts = [
            r[i].rjust(widths[i]) if numeric[i] and n > 0 else r[i].ljust(widths[i])
            for i in range(ncols)
        ]
        lines.append(pad + "  ".join(parts).rstrip())
        if n == 0:
            lines.append(pad + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return shown(str(value))


def _looks_numeric(text: str) -> bool:
    if text in ("-", ""):
        return True
    stripped = text.rstrip("%sx!").replace(".", "", 1).replace(",", "")
    return stripped.isdigit()
