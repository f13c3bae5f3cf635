"""Worker processes that end with their parent, and a main process that ends on SIGTERM / SIGHUP
as it does on Ctrl-C: nothing pipetwin starts is left running.

- :func:`die_with_parent` (first thing in every worker: the executor's ranks, the sweep's pool
  workers): on Linux the kernel sends the worker SIGKILL when its parent dies, ``kill -9``
  included (``prctl(PR_SET_PDEATHSIG)`` through ctypes); elsewhere a daemon thread watches the
  parent's pid and ends the worker within :data:`WATCH_SECONDS`. A parent that died before the
  call is caught too (the worker's parent is no longer the pid it was given).
- :func:`interrupt_on_termination` (around a command's work in the main process): SIGTERM and
  SIGHUP raise :class:`Terminated`, a KeyboardInterrupt, so the cleanup Ctrl-C runs (the
  launcher stopping its ranks, the sweep stopping its pool) runs for them too.

It lives here, below the executor and the commands, because both use it and it needs nothing but
the standard library (a sweep's workers must not import torch for it).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

WATCH_SECONDS = 0.5         # how often the fallback watch looks at the parent
_PR_SET_PDEATHSIG = 1       # <linux/prctl.h>


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the main process (``signum``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _parent_death_signal() -> bool:
    """Ask the kernel for SIGKILL when the parent dies (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    def loop():
        while os.getppid() == parent:
            time.sleep(WATCH_SECONDS)
        os._exit(1)
    threading.Thread(target=loop, name="pipetwin-parent-watch", daemon=True).start()


def die_with_parent(parent: int | None = None) -> None:
    """End this process when ``parent`` (default: the current parent) ends; see the module docstring.
    The signal is tied to the parent's thread that started this process: start workers from a
    thread that lives as long as they should (the main thread)."""
    parent = os.getppid() if parent is None else parent
    if not _parent_death_signal():
        _watch(parent)
    if os.getppid() != parent:      # it died before the signal was asked for
        os._exit(1)


@contextlib.contextmanager
def interrupt_on_termination():
    """SIGTERM and SIGHUP raise :class:`Terminated` in the block (main thread only; elsewhere, and
    where a signal does not exist, the block runs as it is); a signal the process ignores stays
    ignored (``nohup pipetwin ...``); the old handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated(signum)

    old = {}
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, raise_terminated)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
