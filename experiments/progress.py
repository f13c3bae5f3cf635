"""Progress of long commands on stderr, shown only when stderr is a terminal (logs and pipes stay clean).

``bar(iterable, what)`` is a tqdm bar over an iterable; ``counter(what)`` is one fed by a library
loop's own count (a ``progress(i, n)`` callback: the planner's whole-layout search); ``phase(what)``
prints one line per phase of a command that has few long phases (a reproduction), with the seconds
since the command began::

    for cfg in bar(configs, "simulating"): ...
    tick = counter("candidates"); plan_layouts(..., progress=tick); tick.close()
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


class _Counter:
    """``counter``'s callable: ``tick(i, n)`` says the i-th of n is under way. While it is shown, a
    thread redraws the bar every second, so its clock runs while one item takes long (a candidate
    simulated for seconds) and the screen never stands still."""

    def __init__(self, what: str, show: bool):
        import threading
        from tqdm import tqdm
        self._bar = tqdm(total=0, desc=what, disable=not show, leave=False, file=sys.stderr)
        self._done = threading.Event()
        if show:
            threading.Thread(target=self._redraw, daemon=True).start()

    def _redraw(self) -> None:
        while not self._done.wait(1.0):
            self._bar.refresh()

    def __call__(self, i: int, n: int) -> None:
        if self._bar.total != n:
            self._bar.total = n
            self._bar.refresh()
        self._bar.update(i - self._bar.n)

    def close(self) -> None:
        self._done.set()
        self._bar.close()


def counter(what: str, show: bool = True) -> _Counter:
    """A bar (shown when ``show`` and stderr is a terminal) that a loop feeds with ``tick(i, n)``;
    ``tick.close()`` removes it."""
    return _Counter(what, show and enabled())


def phase(what: str) -> None:
    if enabled():
        print(f"pipetwin: [{time.monotonic() - _T0:6.1f} s] {what} ...", file=sys.stderr, flush=True)
