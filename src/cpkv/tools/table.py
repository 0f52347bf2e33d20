"""The one plain-text table of the ``cpkv`` command: benchmark rows, simulator rows, run reports."""

from __future__ import annotations


def format_rows(rows: list[dict], title: str) -> str:
    """A plain text table of benchmark rows."""
    keys = list(rows[0])
    width = {k: max(len(k), *(len(_fmt(r[k])) for r in rows)) for k in keys}
    lines = [title, "  ".join(k.rjust(width[k]) for k in keys)]
    lines += ["  ".join(_fmt(r[k]).rjust(width[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
