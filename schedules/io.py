"""Schedules as files: pipetwin's text form and torch.distributed.pipelining's CSV, in and out.

Two formats hold a compute-only schedule (the F, B and W of every device, in order):

* ``text``: :meth:`Schedule.to_text`, one line per device ``d: tok tok ...`` of op tokens
  (:func:`schedules.ir.parse_op`, a full match per token), devices 0..D-1 in order. Lines that
  start with ``#`` and blank lines are comments. Any schedule, two model copies included
  (``F3.s2.c1``); a token's chunk (``.k1``) must be the one its device's placement gives.
* ``torch-csv``: one row per rank of ``torch.distributed.pipelining`` actions (``0F1``, ``1I0``,
  ``1W0``, ``1B0``; :mod:`schedules.torch_interop`), which ``_PipelineScheduleRuntime._load_csv``
  reads. Single-copy schedules only: a torch action names a stage by its index alone.

What a file gives: D = its device lines (rows), N = 1 + its largest micro-batch index, the
stages and their placement = where their ops run, a split backward = it has W ops. Reading a file
(:func:`parse_schedule_file`) picks the format (a ``.csv`` name is torch's; any other is read by
its first token: ``0F0`` is torch's, ``F0.s0`` pipetwin's), then checks the schedule (every op
once, on the device that holds its stage) and runs it symbolically after lowering
(:func:`schedules.validate.validate`): a deadlock is refused before anything runs, naming the
ranks and the ops they wait at. Every error is one line that starts with the file's name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath

from .registry import check_size
from .ir import COMPUTE_KINDS, Schedule, ScheduleError, make_schedule, parse_op
from .torch_interop import from_torch_text, to_torch_text

FORMATS = ("torch-csv", "text")
FORMAT_NAMES = {"torch-csv": "torch.distributed.pipelining CSV", "text": "pipetwin text"}
_LINE = re.compile(r"\s*(\d+)\s*:(.*)")
_TORCH_FIRST = re.compile(r"\(?\d+[A-Z]")      # 0F0, 12I3, (0F1;3B0)OVERLAP_F_B, 0SEND_F1 ...


# ---------------------------------------------------------------------------------- text form
def from_text(text: str, *, name: str = "text") -> Schedule:
    """The compute-only schedule of :meth:`Schedule.to_text` (``#`` comment lines allowed)."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ScheduleError("no device lines (expected 'd: F0.s0 ...' per device)")
    progs = []
    for i, line in enumerate(lines):
        m = _LINE.fullmatch(line)
        if not m:
            raise ScheduleError(f"line {line.strip()[:40]!r}: expected 'DEVICE: TOKEN TOKEN ...' "
                                f"(e.g. '0: F0.s0 B0.s0')")
        if int(m[1]) != i:
            raise ScheduleError(f"device line {m[1]} where device {i} comes next (devices 0..D-1, one line each)")
        ops = []
        for tok in m[2].split():
            op = parse_op(tok)
            if op.kind not in COMPUTE_KINDS:
                raise ScheduleError(f"device {i}: {tok} is not a compute op; a schedule file holds F, B and W only "
                                    f"(lowering adds the sends, receives, all-reduces and the optimizer step)")
            ops.append(op)
        progs.append(ops)
    placement: dict[tuple[int, int], int] = {}
    for d, ops in enumerate(progs):
        for op in ops:
            if placement.setdefault((op.copy, op.stage), d) != d:
                raise ScheduleError(f"device {d}: {op} runs stage {op.stage}"
                                    + (f" of copy {op.copy}" if op.copy else "")
                                    + f", which device {placement[(op.copy, op.stage)]} runs; a stage lives on "
                                      f"one device")
    if not placement:
        raise ScheduleError("the schedule has no ops")
    C = 1 + max(c for c, _ in placement)
    S = 1 + max(s for _, s in placement)
    missing = [f"stage {s}" + (f" of copy {c}" if c else "") for c in range(C) for s in range(S)
               if (c, s) not in placement]
    if missing:
        raise ScheduleError(f"{', '.join(missing[:3])} never run{'s' if len(missing) == 1 else ''}; every copy must "
                            f"run stages 0..{S - 1}")
    N = 1 + max(op.mb for ops in progs for op in ops)
    split = any(op.kind == "W" for ops in progs for op in ops)
    grid = [[placement[(c, s)] for s in range(S)] for c in range(C)]
    order = [[(op.kind, op.mb, op.copy, op.stage) for op in ops] for ops in progs]
    sched = make_schedule(name, len(progs), N, grid, order, split_backward=split, meta={"source": "text"})
    for d, (given, built) in enumerate(zip(progs, sched.programs)):
        for a, b in zip(given, built):
            if a.chunk != b.chunk:
                raise ScheduleError(f"device {d}: {a} says chunk {a.chunk}, but stage {a.stage} is chunk {b.chunk} "
                                    f"of device {d} (chunks count a device's stages by copy, then stage): write {b}")
    return sched


# ---------------------------------------------------------------------------------- export
def export_text(sched: Schedule, fmt: str) -> str:
    """``sched`` (compute-only) written in format ``fmt`` (:data:`FORMATS`), ending with a newline;
    a format that cannot express it: ScheduleError, one line saying why."""
    if fmt not in FORMATS:
        raise ScheduleError(f"--format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if sched.lowered:
        raise ScheduleError(f"{sched.name} is lowered; export its compute-only form")
    if fmt == "text":
        head = (f"# pipetwin schedule {sched.name}: D={sched.num_devices} N={sched.num_microbatches} "
                f"stages={sched.num_stages}" + (f" copies={sched.num_copies}" if sched.num_copies > 1 else ""))
        return head + "\n" + sched.to_text() + "\n"
    if sched.num_copies != 1:
        raise ScheduleError(f"{sched.name} runs {sched.num_copies} model copies (a stage index on two devices); "
                            f"torch.distributed.pipelining's CSV names a stage by its index alone, one rank per stage: "
                            f"export it with --format text")
    return to_torch_text(sched) + "\n"


# ---------------------------------------------------------------------------------- files
@dataclass(frozen=True)
class ScheduleFile:
    """A schedule read from a file: its ``path``, ``format`` (:data:`FORMATS`), ``how`` the format
    was picked, and the compute-only ``schedule`` (checked: structure and deadlock-free),
    named after the file (``name``)."""

    path: str
    format: str
    how: str
    schedule: Schedule

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def chunks(self) -> int:
        """Chunks (stages) per device: the most any device holds."""
        return self.schedule.max_chunks

    def describe(self) -> str:
        """One line: the file, its format and how it was picked, and what it schedules."""
        s = self.schedule
        return (f"{self.path} ({FORMAT_NAMES[self.format]}, {self.how}): D={s.num_devices} N={s.num_microbatches}, "
                f"{s.num_stages} stages" + (f" x {s.num_copies} copies" if s.num_copies > 1 else "")
                + (", split backward" if s.split_backward else ""))


def pick_format(text: str, path: str) -> tuple[str, str]:
    """(format, how it was picked): a ``.csv`` name is torch's; otherwise the first token decides."""
    if PurePath(path).suffix.lower() == ".csv":
        return "torch-csv", "by its .csv name"
    for line in text.splitlines():
        body = line.strip()
        if not body or body.startswith("#"):
            continue
        body = re.sub(r"^(?:Rank\s+)?\d+\s*:\s*", "", body)
        first = re.split(r"[,\s]", body, maxsplit=1)[0]
        if first:
            return ("torch-csv" if _TORCH_FIRST.match(first) else "text"), "by its content"
    return "text", "by its content"


def parse_schedule_file(text: str, path: str) -> ScheduleFile:
    """Read a schedule file's ``text`` (format by :func:`pick_format`), check its structure and run it
    symbolically (a deadlock names the ranks and ops); ScheduleError starting with the file's name."""
    from .validate import validate
    name = PurePath(path).name
    fmt, how = pick_format(text, path)
    try:
        if fmt == "torch-csv":
            body = "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))
            sched = from_torch_text(body, name=name)
        else:
            sched = from_text(text, name=name)
        idle = [d for d, prog in enumerate(sched.programs) if not prog]
        if idle:
            raise ScheduleError(f"device {idle[0]} runs no op; every device (row) must hold a stage")
        check_size(sched.num_devices, sched.num_microbatches, 1, sched.max_chunks)
        validate(sched)
    except ScheduleError as e:
        raise ScheduleError(f"{name} ({FORMAT_NAMES[fmt]}, {how}): {e}") from None
    return ScheduleFile(str(path), fmt, how, sched)
