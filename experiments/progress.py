"""Progress of long commands on stderr, shown only when stderr is a terminal (logs and pipes stay clean).

``bar(iterable, what)`` is a tqdm bar over an iterable; ``phase(what)`` prints one line per phase of
a command that has few long phases (a reproduction), with the seconds since the command began::

    for cfg in bar(configs, "simulating"): ...
    phase("bubble scaling")
"""
from __future__ import annotations

import sys
import time

_T0 = time.monotonic()


def enabled() -> bool:
    return sys.stderr.isatty()


def bar(iterable, what: str, total: int | None = None):
    from tqdm import tqdm
    return tqdm(iterable, desc=what, total=total, disable=not enabled(), leave=False, file=sys.stderr)


def phase(what: str) -> None:
    if enabled():
        print(f"pipetwin: [{time.monotonic() - _T0:6.1f} s] {what} ...", file=sys.stderr, flush=True)
