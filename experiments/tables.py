"""Tables as text: aligned columns for the terminal and GitHub markdown for reports, one formatter."""
from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

from cost_models.memory import BYTE_UNITS, byte_unit, fmt_bytes  # noqa: F401  (one home: the ledger's)


WIDTH = 120        # the widest a table or a line of prose prints (text columns wrap to fit)


def printable(text) -> str:
    """``text`` with control and other unprintable characters escaped (``\\x1b``, ``\\u200b``), as
    every name (model, cluster, schedule, file) is printed; newlines collapse into spaces."""
    s = " ".join(str(text).split("\n"))
    return s if s.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def one_line_message(text) -> str:
    """An error message as the one line ``pipetwin: error: ...`` prints: newlines and runs of spaces
    as one space, unprintable characters escaped, and a quoted value (no spaces) of more than 80
    characters (a 6,000-character --device-map echoed back) cut to its first 60 and its length."""
    line = " ".join(x for x in printable(text).split(" ") if x)
    return _LONG_QUOTE.sub(lambda m: f"{m[1]}{m[2][:60]}...{m[1]} ({len(m[2]):,} characters)", line)


_LONG_QUOTE = re.compile(r"""(?<![\w'"])(['"])([^'"\s]{81,})\1(?![\w'"])""")   # one quoted word: a value, not prose


def _cell(value, fmt: str | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt is not None:
        return fmt.format(value) if "{" in fmt else format(value, fmt)
    return printable(value)


def fmt_table(rows: Sequence[Mapping], cols: Sequence[str], fmts: Mapping[str, str] | None = None, *,
              markdown: bool = False, floatfmt: str | None = None, width: int = WIDTH) -> str:
    """``rows`` (dicts) as a table of ``cols``. ``fmts``: per column, a ``str.format`` pattern
    (``"{:.4f}"``) or a format spec (``".4f"``); ``floatfmt``: the spec for float cells of other
    columns. Missing values and NaN print as ``-``. ``markdown=True`` writes a GitHub markdown
    table, otherwise columns are aligned with two spaces between them, within ``width`` characters
    (the widest columns' cells wrap onto more lines); text cells print with :func:`printable`."""
    fmts = dict(fmts or {})

    def fmt_of(col, v):
        return fmts.get(col, floatfmt if isinstance(v, float) else None)

    cells = [[_cell(r.get(c), fmt_of(c, r.get(c))) for c in cols] for r in rows]
    if markdown:
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        return "\n".join(out + ["| " + " | ".join(row) + " |" for row in cells])
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    widths = _fit(widths, cols, width)
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    for row in cells:
        parts = [wrap_cell(x, w, hard=True) if len(x) > w else [x] for x, w in zip(row, widths)]
        for k in range(max(map(len, parts))):
            out.append("  ".join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths)).rstrip())
    return "\n".join(out)


def _fit(widths: list[int], cols, width: int) -> list[int]:
    """Column widths within ``width`` characters: the widest columns narrowed (their cells wrap), none
    below its header or 12 characters."""
    widths = list(widths)
    while sum(widths) + 2 * (len(widths) - 1) > width:
        i = max(range(len(widths)), key=lambda j: widths[j] - max(len(cols[j]), 12))
        floor = max(len(cols[i]), 12)
        if widths[i] <= floor:
            break
        widths[i] = max(floor, widths[i] - (sum(widths) + 2 * (len(widths) - 1) - width))
    return widths


def markdown(df, floatfmt: str = ".4g") -> str:
    """A pandas DataFrame as a markdown table (floats with ``floatfmt``)."""
    return fmt_table(df.to_dict("records"), list(df.columns), markdown=True, floatfmt=floatfmt)





def wrap_cell(text: str, width: int, hard: bool = False) -> list[str]:
    """``text`` cut at spaces into lines of at most ``width`` characters (long words stay whole
    unless ``hard``)."""
    import textwrap
    return textwrap.wrap(str(text), width, break_long_words=hard, break_on_hyphens=False) or [""]


def group_rows(rows: Sequence[Mapping], key: str, cols: Sequence[str], fmts: Mapping[str, str] | None = None,
               *, keep: int = 32) -> list[dict]:
    """Rows alike in every printed column but ``key`` (identical replicas) as one row each: ``key``
    lists the members (``0, 8, .., 1016`` for an even stride) and ``count`` says how many. Tables of
    at most ``keep`` rows stay as they are (count 1)."""
    fmts = dict(fmts or {})
    if len(rows) <= keep:
        return [{**r, "count": 1} for r in rows]
    groups: dict[tuple, list] = {}
    for r in rows:
        sig = tuple(_cell(r.get(c), fmts.get(c)) for c in cols if c != key)
        groups.setdefault(sig, []).append(r)
    out = []
    for members in groups.values():
        ids = [m[key] for m in members]
        out.append({**members[0], key: _members(ids), "count": len(ids)})
    return out


def _members(ids: list) -> str:
    if len(ids) <= 3:
        return ", ".join(map(str, ids))
    steps = {b - a for a, b in zip(ids, ids[1:])} if all(isinstance(i, int) for i in ids) else set()
    if len(steps) == 1:
        return f"{ids[0]}, {ids[1]}, .., {ids[-1]}"
    return f"{ids[0]}, {ids[1]}, .. ({len(ids)})"
