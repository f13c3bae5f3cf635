"""The schedule IR: ops, placement and per-device programs.

An :class:`Op` is one thing a device does. Compute ops (F, B, W) come from a schedule family;
lowering (:mod:`schedules.lower`) adds the communication ops (SEND, RECV, COPY), gradient
synchronisation (ALLREDUCE) and the optimizer step (OPTIM).

Every op prints as a short token and parses back with a full match::

    F3.s2          forward of micro-batch 3 on global stage 2 (copy 0, chunk 0)
    B3.s2.c1.k1    backward, model copy 1 ("up"), chunk 1 of its device
    W3.s2          weight-gradient half of a split backward
    SA3.s2>1       send the activation stage 2 produced for micro-batch 3 to device 1
    RA3.s3<0       receive stage 3's input activation for micro-batch 3 from device 0
    SG3.s2>0       send the gradient w.r.t. stage 2's input to device 0
    RG3.s1<2       receive stage 1's output gradient from device 2
    CA3.s3         local hand-off of stage 3's activation to stage 4 on the same device
    CG3.s4         local hand-off of stage 4's input gradient to stage 3 on the same device
    AR.s2          all-reduce stage 2's gradients over every device holding a copy of it
    OPT            optimizer step

SEND and COPY name the producing stage, RECV names the consuming stage; the message they carry
is identified by :func:`message_key`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

F, B, W = "F", "B", "W"
SEND, RECV, COPY = "SEND", "RECV", "COPY"
ALLREDUCE, OPTIM = "ALLREDUCE", "OPTIM"
COMPUTE_KINDS = (F, B, W)
_COMPUTE_SET = frozenset(COMPUTE_KINDS)
ACT, GRAD = "act", "grad"


class ScheduleError(ValueError):
    """A schedule that cannot be built, lowered or executed; the message says what to change."""


@dataclass(frozen=True, slots=True, order=True)
class Op:
    kind: str
    mb: int = -1
    stage: int = -1
    copy: int = 0
    chunk: int = 0
    peer: int = -1
    payload: str = ""
    _tok: str | None = field(default=None, compare=False, repr=False, hash=False)

    # ------------------------------------------------------------------ tokens
    def __str__(self) -> str:  # noqa: D105
        tok = self._tok
        if tok is None:
            tok = self._token()
            object.__setattr__(self, "_tok", tok)   # ops are immutable: the token is cached
        return tok

    def _token(self) -> str:
        suffix = ""
        if self.copy:
            suffix += f".c{self.copy}"
        if self.chunk:
            suffix += f".k{self.chunk}"
        k = self.kind
        if k in COMPUTE_KINDS:
            return f"{k}{self.mb}.s{self.stage}{suffix}"
        p = "A" if self.payload == ACT else "G"
        if k == SEND:
            return f"S{p}{self.mb}.s{self.stage}{suffix}>{self.peer}"
        if k == RECV:
            return f"R{p}{self.mb}.s{self.stage}{suffix}<{self.peer}"
        if k == COPY:
            return f"C{p}{self.mb}.s{self.stage}{suffix}"
        if k == ALLREDUCE:
            return f"AR.s{self.stage}{suffix}"
        if k == OPTIM:
            return "OPT"
        raise ScheduleError(f"unknown op kind {k!r}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


def _fast_constructor():
    """``new_op(kind, mb, stage, copy, chunk, peer, payload)``: an :class:`Op` like ``Op(...)``, for
    the passes that make one per op of a whole schedule (building, lowering): it sets the slots
    directly instead of going through the frozen dataclass's checked ``__init__`` (40% less time)."""
    new = object.__new__
    setters = [getattr(Op, f).__set__ for f in ("kind", "mb", "stage", "copy", "chunk", "peer", "payload", "_tok")]
    sk, sm, ss, sc, sch, sp, spl, st = setters

    def new_op(kind: str, mb: int = -1, stage: int = -1, copy: int = 0, chunk: int = 0, peer: int = -1,
               payload: str = "") -> Op:
        o = new(Op)
        sk(o, kind)
        sm(o, mb)
        ss(o, stage)
        sc(o, copy)
        sch(o, chunk)
        sp(o, peer)
        spl(o, payload)
        st(o, None)
        return o

    return new_op


new_op = _fast_constructor()


_TOKEN = re.compile(
    r"(?:(?P<ck>[FBW])(?P<cmb>\d+)\.s(?P<cst>\d+)"
    r"|(?P<tk>[SRC])(?P<pl>[AG])(?P<tmb>\d+)\.s(?P<tst>\d+)"
    r"|AR\.s(?P<ast>\d+)"
    r"|(?P<opt>OPT))"
    r"(?:\.c(?P<copy>\d+))?(?:\.k(?P<chunk>\d+))?"
    r"(?:(?P<dir>[<>])(?P<peer>\d+))?"
)


def parse_op(token: str) -> Op:
    """Parse a token printed by ``str(op)`` (full match) back into an :class:`Op`."""
    m = _TOKEN.fullmatch(token.strip())
    if not m:
        raise ScheduleError(f"cannot parse op token {token!r} (expected e.g. F3.s2, B0.s1.c1, SA3.s2>1, AR.s0, OPT)")
    copy = int(m["copy"] or 0)
    chunk = int(m["chunk"] or 0)
    if m["ck"]:
        if m["dir"]:
            raise ScheduleError(f"compute op {token!r} cannot have a peer")
        return Op(m["ck"], int(m["cmb"]), int(m["cst"]), copy, chunk)
    if m["tk"]:
        kind = {"S": SEND, "R": RECV, "C": COPY}[m["tk"]]
        payload = ACT if m["pl"] == "A" else GRAD
        want = {SEND: ">", RECV: "<", COPY: None}[kind]
        if (m["dir"] or None) != want:
            raise ScheduleError(f"op token {token!r}: {kind} needs {'no peer' if want is None else want + 'PEER'}")
        peer = int(m["peer"]) if m["peer"] else -1
        return Op(kind, int(m["tmb"]), int(m["tst"]), copy, chunk, peer, payload)
    if m["dir"]:
        raise ScheduleError(f"op token {token!r} cannot have a peer")
    if m["ast"]:
        return Op(ALLREDUCE, -1, int(m["ast"]), copy, chunk)
    return Op(OPTIM)


def producer_stage(payload: str, consumer: int) -> int:
    """The stage that produces a message ``consumer`` takes in: activations flow down the stages
    (from ``consumer - 1``), gradients up (from ``consumer + 1``). The one statement of that rule."""
    return consumer - 1 if payload == ACT else consumer + 1


def consumer_stage(payload: str, producer: int) -> int:
    """The inverse of :func:`producer_stage`: the stage a message of ``producer`` is for."""
    return producer + 1 if payload == ACT else producer - 1


def source_stage(op: Op) -> int:
    """The producing stage of the message a SEND/RECV/COPY carries (SEND and COPY name it,
    a RECV names the consuming stage)."""
    if op.kind in (SEND, COPY):
        return op.stage
    if op.kind == RECV:
        return producer_stage(op.payload, op.stage)
    raise ScheduleError(f"{op} carries no message")


def message_key(op: Op) -> tuple:
    """Identify the message a SEND/RECV/COPY carries: (payload, copy, micro-batch, producing stage)."""
    return (op.payload, op.copy, op.mb, source_stage(op))


def activation_change(kind: str, act: float, act_w: float, split: bool) -> tuple[float, float]:
    """(allocated when the op starts, freed when it ends) of activation memory, for a compute op of
    a (copy, stage) that keeps ``act`` from its F to its backward, of which ``act_w`` stays until the
    W of a split backward. The one statement of the activation rule every engine and analysis uses:
    F allocates ``act``; a full B frees it; a split B frees ``act - act_w``; W frees ``act_w``.
    (A negative free is an allocation at the op's end: e.g. counting only what waits for W.)"""
    if kind == F:
        return act, 0.0
    if kind == B:
        return 0.0, (act - act_w) if split else act
    if kind == W:
        return 0.0, act_w
    raise ScheduleError(f"{kind} is not a compute op")


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: who holds which stage, and what each device runs in which order.

    ``placement[copy][stage]`` is the device (0..num_devices-1) holding that stage of that model
    copy. ``programs[d]`` is device d's ordered op list: compute only (F/B/W) before lowering, with
    SEND/RECV/COPY/ALLREDUCE/OPTIM after. With ``replicas`` R > 1, ranks r*D + d (r < R) run the
    program of device d on their own share of the micro-batches and all-reduce across replicas.
    """

    name: str
    num_devices: int
    num_microbatches: int
    num_stages: int
    placement: tuple[tuple[int, ...], ...]
    programs: tuple[tuple[Op, ...], ...]
    split_backward: bool = False
    replicas: int = 1
    lowered: bool = False
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_copies(self) -> int:
        return len(self.placement)

    @property
    def num_ranks(self) -> int:
        return self.num_devices * self.replicas

    def stages_on(self, device: int) -> list[tuple[int, int]]:
        """(copy, stage) pairs held by a device, in chunk order."""
        return [cs for cs in self._chunk_order() if self.placement[cs[0]][cs[1]] == device]

    def _chunk_order(self):
        return [(c, s) for c in range(self.num_copies) for s in range(self.num_stages)]

    def chunk_of(self, copy: int, stage: int) -> int:
        return self.stages_on(self.placement[copy][stage]).index((copy, stage))

    @property
    def max_chunks(self) -> int:
        return max(len(self.stages_on(d)) for d in range(self.num_devices))

    def stage_group(self, stage: int) -> list[int]:
        """Ranks holding a copy of ``stage`` (all model copies, all replicas), sorted."""
        devs = {self.placement[c][stage] for c in range(self.num_copies)}
        return sorted(r * self.num_devices + d for r in range(self.replicas) for d in devs)

    def rank_device(self, rank: int) -> int:
        return rank % self.num_devices

    def program(self, rank: int) -> tuple[Op, ...]:
        """The program a rank runs: replicas run their device's program with peers shifted."""
        if not 0 <= rank < self.num_ranks:
            raise ScheduleError(f"rank {rank} out of range 0..{self.num_ranks - 1}")
        offset = rank - self.rank_device(rank)
        prog = self.programs[self.rank_device(rank)]
        if offset == 0:
            return prog
        return tuple(new_op(o.kind, o.mb, o.stage, o.copy, o.chunk, o.peer + offset, o.payload) if o.peer >= 0 else o
                     for o in prog)

    def copy_of_microbatch(self) -> dict[int, int]:
        out = {}
        for prog in self.programs:
            for o in prog:
                if o.kind == F:
                    out[o.mb] = o.copy
        return out

    def compute_programs(self) -> list[list[Op]]:
        return [[o for o in p if o.kind in _COMPUTE_SET] for p in self.programs]

    def to_text(self) -> str:
        """One line per device: ``d: tok tok ...``, each token as :func:`schedules.ir.parse_op` reads it."""
        return "\n".join(f"{d}: " + " ".join(map(str, p)) for d, p in enumerate(self.programs))

    def with_programs(self, programs: Sequence[Iterable[Op]], **changes) -> "Schedule":
        kw = dict(name=self.name, num_devices=self.num_devices, num_microbatches=self.num_microbatches,
                  num_stages=self.num_stages, placement=self.placement,
                  programs=tuple(tuple(p) for p in programs), split_backward=self.split_backward,
                  replicas=self.replicas, lowered=self.lowered, meta=dict(self.meta))
        kw.update(changes)
        return Schedule(**kw)


def make_schedule(name: str, num_devices: int, num_microbatches: int, placement, order, *,
                  split_backward: bool = False, meta: dict | None = None) -> Schedule:
    """Build a compute-only Schedule from ``order[d]`` = list of (kind, mb, copy, stage) tuples.

    Fills each op's chunk from the placement, so schedule families only state what runs where.
    """
    placement = tuple(tuple(int(x) for x in row) for row in placement)
    num_stages = len(placement[0])
    if any(len(row) != num_stages for row in placement):
        raise ScheduleError("every model copy must have the same number of stages")
    sched = Schedule(name, num_devices, num_microbatches, num_stages, placement, (),
                     split_backward=split_backward, meta=dict(meta or {}))
    chunk = {}
    for d in range(num_devices):
        for k, (c, s) in enumerate(sched.stages_on(d)):
            chunk[(c, s)] = k
    progs = []
    for d in range(num_devices):
        prog = []
        for kind, mb, c, s in order[d]:
            prog.append(new_op(kind, mb, s, c, chunk[(c, s)]))
        progs.append(tuple(prog))
    return sched.with_programs(progs)
