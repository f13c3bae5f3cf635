"""Fault injection: a rank that raises when it reaches one op of its program, to try out how a
failing rank ends the run (exit status 1 with that rank's traceback, :mod:`executor.launch`).

A fault is written ``RANK:TOKEN[:STEP]`` (``--inject-fault``, ``RunConfig.fault``): rank ``RANK``
raises when it reaches the op printed as ``TOKEN`` (``F3.s1``, ``RA2.s1<0``; the IR's op tokens,
:func:`schedules.parse_op`), in step ``STEP`` (default: the first time). :func:`parse_fault`
checks the syntax where a config is made; :func:`check_fault` checks it against the lowered
schedule before any rank starts, so an injected fault cannot silently never fire.

With expert parallelism the token may also be :data:`A2A` (``1:a2a``, ``1:a2a:2``): rank ``RANK``
is killed by SIGKILL (as the out-of-memory killer would) inside its first expert all-to-all of
step ``STEP`` (default the first step), after exchanging the row counts, while its EP peers wait in
the same all-to-all for its rows (:func:`executor.expert_parallel.arm_kill`): the launcher names
the killed rank (:mod:`executor.launch`). This module
imports nothing of the executor: the config and the runtime both read faults through it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from schedules import Schedule


A2A = "a2a"     # the token of a rank killed inside an expert all-to-all (module docstring)
WORKDIR_ENV = "PIPETWIN_WORKDIR"    # a spawned rank's launcher folder (executor.launch)


def note_injected_kill(what: str) -> None:
    """Leave ``injected.RANK`` (saying ``what``) in a spawned rank's launcher folder before the rank
    kills itself, so the launcher reports the kill as injected, not as one from outside the run
    (kill -9, the out-of-memory killer). Under torchrun there is no such folder: nothing is left."""
    work, rank = os.environ.get(WORKDIR_ENV), os.environ.get("RANK")
    if work and rank is not None:
        Path(work, f"injected.{rank}").write_text(what)


class FaultError(ValueError):
    """A fault to inject that is malformed or would never fire."""


@dataclass(frozen=True)
class Fault:
    """An injected fault: ``rank`` raises when it reaches the op printed as ``token`` (e.g. ``F3.s1``,
    ``RA2.s1<0``; :func:`schedules.parse_op` reads them), in step ``step`` (None: the first time)."""

    rank: int
    token: str
    step: int | None = None


def parse_fault(text: str) -> Fault:
    """``"RANK:TOKEN[:STEP]"`` -> :class:`Fault` (syntax only; :func:`check_fault` checks it against a run)."""
    parts = str(text).split(":")
    try:
        if len(parts) not in (2, 3) or not parts[1]:
            raise ValueError
        rank, step = int(parts[0]), (int(parts[2]) if len(parts) == 3 else None)
    except ValueError:
        raise FaultError(f"a fault is RANK:TOKEN[:STEP], e.g. 1:F2.s1 or 0:B0.s0:1; got {text!r}") from None
    if rank < 0 or (step is not None and step < 0):
        raise FaultError(f"a fault's rank and step must be >= 0; got {text!r}")
    return Fault(rank, parts[1], step)


def check_fault(fault: str | None, low: Schedule, steps: int, ep: int = 1) -> Fault | None:
    """The fault ``fault`` of a run of lowered schedule ``low`` for ``steps`` steps, checked: its rank
    exists, its token is an op of that rank's program (or :data:`A2A` in a run with expert
    parallelism, ``ep`` > 1) and its step is one the run takes (None: no fault)."""
    if fault is None:
        return None
    f = parse_fault(fault)
    if f.rank >= low.num_ranks:
        raise FaultError(f"fault {fault!r}: the run has ranks 0..{low.num_ranks - 1}")
    tokens = [str(op) for op in low.program(f.rank)]
    if f.token == A2A and ep == 1:
        raise FaultError(f"fault {fault!r}: {A2A} kills a rank inside an expert all-to-all; the run has none "
                         f"(give --ep > 1)")
    if f.token not in tokens and f.token != A2A:
        raise FaultError(f"fault {fault!r}: rank {f.rank} runs no op {f.token!r}; its program is "
                         f"{' '.join(tokens[:8])}{' ...' if len(tokens) > 8 else ''}")
    if f.step is not None and f.step >= steps:
        raise FaultError(f"fault {fault!r}: the run has steps 0..{steps - 1}")
    return f
