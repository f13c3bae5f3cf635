"""Tables as text: aligned columns for the terminal and GitHub markdown for reports, one formatter."""
from __future__ import annotations

import math
from typing import Mapping, Sequence


def _cell(value, fmt: str | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt is not None:
        return fmt.format(value) if "{" in fmt else format(value, fmt)
    return str(value)


def fmt_table(rows: Sequence[Mapping], cols: Sequence[str], fmts: Mapping[str, str] | None = None, *,
              markdown: bool = False, floatfmt: str | None = None) -> str:
    """``rows`` (dicts) as a table of ``cols``. ``fmts``: per column, a ``str.format`` pattern
    (``"{:.4f}"``) or a format spec (``".4f"``); ``floatfmt``: the spec for float cells of other
    columns. Missing values and NaN print as ``-``. ``markdown=True`` writes a GitHub markdown
    table, otherwise columns are aligned with two spaces between them."""
    fmts = dict(fmts or {})

    def fmt_of(col, v):
        return fmts.get(col, floatfmt if isinstance(v, float) else None)

    cells = [[_cell(r.get(c), fmt_of(c, r.get(c))) for c in cols] for r in rows]
    if markdown:
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        return "\n".join(out + ["| " + " | ".join(row) + " |" for row in cells])
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def markdown(df, floatfmt: str = ".4g") -> str:
    """A pandas DataFrame as a markdown table (floats with ``floatfmt``)."""
    return fmt_table(df.to_dict("records"), list(df.columns), markdown=True, floatfmt=floatfmt)


BYTE_UNITS = (("B", 1), ("KiB", 2 ** 10), ("MiB", 2 ** 20), ("GiB", 2 ** 30), ("TiB", 2 ** 40))


def byte_unit(values) -> tuple[str, int]:
    """The binary unit that shows ``values`` (bytes) best: the largest in which the biggest value is >= 1."""
    top = max((abs(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))), default=0)
    name, div = BYTE_UNITS[0]
    for n, d in BYTE_UNITS:
        if top >= d:
            name, div = n, d
    return name, div


def fmt_bytes(n: float) -> str:
    """One size in its own best unit: ``2.11 MiB``."""
    name, div = byte_unit([n])
    return f"{n:.0f} B" if div == 1 else f"{n / div:.3g} {name}"


def wrap_cell(text: str, width: int) -> list[str]:
    """``text`` cut at spaces into lines of at most ``width`` characters (long words stay whole)."""
    import textwrap
    return textwrap.wrap(str(text), width, break_long_words=False, break_on_hyphens=False) or [""]
