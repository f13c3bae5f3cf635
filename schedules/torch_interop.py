"""Exchange single-copy schedules with ``torch.distributed.pipelining``'s action text.

PyTorch (2.4+, checked against 2.13) writes a pipeline order as one row per rank of action
tokens ``<stage><type><micro-batch>`` (``_Action.__repr__`` / ``_Action.from_str``), e.g.
``0F1`` (stage 0 forward of micro-batch 1). Its compute types are::

    F  FORWARD            our F
    B  FULL_BACKWARD      our B of a schedule that does not split the backward
    I  BACKWARD_INPUT     our B of a split-backward schedule (input gradient)
    W  BACKWARD_WEIGHT    our W
    (0F3;5B1)OVERLAP_F_B  an overlapped forward/backward pair (DualPipeV)

and its communication / FSDP / gradient-reduction actions (``SEND_F``, ``RECV_F``, ``SEND_B``,
``RECV_B``, ``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``) carry no micro-batch work. Rows are
comma separated, which is the CSV format ``_PipelineScheduleRuntime._load_csv`` reads; empty
cells (PyTorch's ``None`` idle steps) are allowed.

PyTorch stage indices are global and one stage lives on one rank, so only single-copy
schedules (one model copy, any placement: straight, looped or V) can be exchanged; replicas
are a data-parallel matter outside the pipeline order and are not exported.

Mapping rules (both directions):

- Export: F -> ``F``; B -> ``B`` when the schedule does not split the backward, else ``I``;
  W -> ``W``. A split schedule may mark some backwards as full (``meta["full_backward"]``, a
  list of (stage, micro-batch)); when such a B is immediately followed on its rank by its own W,
  the pair is written as one ``B`` (``merge_backward=None``, the default). ``merge_backward=True``
  merges every adjacent B/W pair of the same stage and micro-batch (PyTorch's ``_merge_bw``),
  ``False`` none. With ``overlap=True`` the pairs listed in ``meta["overlapped"]`` are written as
  ``(a;b)OVERLAP_F_B`` tokens (DualPipe-V); by default every op is its own token.
- Import: a schedule that contains any ``I`` or ``W`` becomes a split-backward schedule in which
  a full ``B`` is an input-gradient B immediately followed by its W (recorded in
  ``meta["full_backward"]``); otherwise ``B`` stays a full backward. ``OVERLAP_F_B`` tokens are
  flattened into consecutive ops in the order written (recorded in ``meta["overlapped"]``).
  Non-compute actions are skipped. The placement is inferred (the rank that runs a stage holds
  it); a stage that appears on two ranks or a missing stage is an error.

The module does not import torch (``schedules`` stays torch-free); the tests feed its text to
PyTorch's ``_Action.from_str``, ``_add_send_recv`` and ``_simulate_comms_compute``.
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

from .ir import B, F, Schedule, ScheduleError, W, make_schedule

_TOKEN = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_COMPUTE = {"F", "I", "B", "W"}

# The single-copy family nearest to each multi-copy one, which torch's CSV can hold: each of
# Chimera's two pipelines is a 1F1B (dapple); BitPipe's (and its zero-bubble form's) are V-shaped
# with two chunks a device, as zb-v's one (torch's ScheduleZBVZeroBubble).
NEAREST_SINGLE_COPY = {"chimera": "dapple", "bitpipe": "zb-v", "bitpipe-zb": "zb-v"}


def single_copy_refusal(sched: Schedule) -> str | None:
    """Why torch's pipeline order cannot hold ``sched`` and what it can run instead; None when it can."""
    if sched.num_copies == 1:
        return None
    nearest = NEAREST_SINGLE_COPY.get(sched.name, "a single-copy schedule (dapple, interleaved, zb-v, ...)")
    return (f"{sched.name} has {sched.num_copies} model copies; PyTorch's pipeline order can only express "
            f"single-copy schedules (an action names a stage by its index, one rank holds it): the nearest it "
            f"runs is {nearest}")


# ---------------------------------------------------------------------------------------- export
def to_torch_actions(sched: Schedule, *, merge_backward: bool | None = None,
                     overlap: bool = False) -> list[list[str]]:
    """Per rank, the compute action tokens PyTorch would print for ``sched``."""
    refusal = single_copy_refusal(sched)
    if refusal is not None:
        raise ScheduleError(refusal)
    full = {tuple(x) for x in sched.meta.get("full_backward", ())}
    pairs = {(tuple(a), tuple(b)) for a, b in sched.meta.get("overlapped", ())} if overlap else set()
    rows = []
    for prog in sched.compute_programs():
        # units: one op, or a B immediately followed by its own W written as one full backward
        units: list[tuple[tuple, str]] = []
        i = 0
        while i < len(prog):
            op = prog[i]
            nxt = prog[i + 1] if i + 1 < len(prog) else None
            merged = (sched.split_backward and op.kind == B and nxt is not None and nxt.kind == W
                      and (nxt.stage, nxt.mb) == (op.stage, op.mb)
                      and (merge_backward is True or (merge_backward is None and (op.stage, op.mb) in full)))
            letter = {F: "F", W: "W"}.get(op.kind) or ("B" if merged or not sched.split_backward else "I")
            units.append(((op.kind, op.stage, op.mb), f"{op.stage}{letter}{op.mb}"))
            i += 2 if merged else 1
        toks: list[str] = []
        j = 0
        while j < len(units):
            if j + 1 < len(units) and (units[j][0], units[j + 1][0]) in pairs:
                toks.append(f"({units[j][1]};{units[j + 1][1]})OVERLAP_F_B")
                j += 2
            else:
                toks.append(units[j][1])
                j += 1
        rows.append(toks)
    return rows


def to_torch_text(sched: Schedule, *, sep: str = ",", merge_backward: bool | None = None,
                  overlap: bool = False) -> str:
    """One row per rank, tokens joined by ``sep`` (``,`` = the CSV ``_load_csv`` reads)."""
    return "\n".join(sep.join(r) for r in to_torch_actions(sched, merge_backward=merge_backward,
                                                           overlap=overlap))


# ---------------------------------------------------------------------------------------- import
def _split_row(row: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in row:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if depth == 0 and (ch == "," or ch.isspace()):
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return out


def from_torch_text(text: str, **kw) -> Schedule:
    """Parse rows of action tokens (comma or whitespace separated, one row per rank, blank cells
    allowed; a leading ``Rank k:`` / ``k:`` label is ignored) into a compute-only Schedule."""
    rows = []
    for line in text.strip("\n").splitlines():
        line = re.sub(r"^\s*(?:Rank\s+)?\d+\s*:", "", line)
        rows.append([t for t in _split_row(line) if t.strip()])
    return from_torch_order(rows, **kw)


def _parse(tok: str, rank: int) -> list[tuple[str, int, int]]:
    """(pytorch type letter, stage, mb) of the compute work in one token; [] for other actions."""
    tok = tok.strip()
    m = _OVERLAP.fullmatch(tok)
    if m:
        subs = [s for s in m[1].split(";") if s.strip()]
        out = []
        for s in subs:
            got = _parse(s, rank)
            if len(got) != 1:
                raise ScheduleError(f"rank {rank}: OVERLAP_F_B sub-action {s!r} is not a compute action")
            out += got
        return out
    m = _TOKEN.fullmatch(tok)
    if not m:
        raise ScheduleError(f"rank {rank}: cannot parse PyTorch action {tok!r} "
                            f"(expected e.g. 0F1, 1B0, 2I3, 2W3, (0F1;3B0)OVERLAP_F_B)")
    stage, kind, mb = m.groups()
    if kind not in _COMPUTE:
        return []
    if not mb:
        raise ScheduleError(f"rank {rank}: compute action {tok!r} has no micro-batch index")
    return [(kind, int(stage), int(mb))]


def from_torch_order(order: Mapping[int, Sequence] | Sequence[Sequence], *, name: str = "torch",
                     num_stages: int | None = None, num_microbatches: int | None = None) -> Schedule:
    """Import a PyTorch pipeline order: ``{rank: [action or None, ...]}`` (e.g. a schedule's
    ``pipeline_order``) or a list of rows; actions may be ``_Action`` objects or token strings."""
    if isinstance(order, Mapping):
        ranks = sorted(order)
        if ranks != list(range(len(ranks))):
            raise ScheduleError(f"ranks must be 0..{len(ranks) - 1}; got {ranks}")
        rows = [order[r] for r in ranks]
    else:
        rows = list(order)
    if not rows:
        raise ScheduleError("empty pipeline order")
    D = len(rows)
    parsed: list[list[tuple[tuple[str, int, int], ...]]] = []
    for r, row in enumerate(rows):
        items = []
        for a in row:
            if a is None or (isinstance(a, str) and not a.strip()):
                continue
            got = _parse(str(a), r)
            if got:
                items.append(tuple(got))
        parsed.append(items)
    flat = [x for items in parsed for grp in items for x in grp]
    if not flat:
        raise ScheduleError("the pipeline order has no compute actions")
    split = any(k in ("I", "W") for k, _, _ in flat)
    S = num_stages if num_stages is not None else max(s for _, s, _ in flat) + 1
    N = num_microbatches if num_microbatches is not None else max(m for _, _, m in flat) + 1
    rank_of: dict[int, int] = {}
    for r, items in enumerate(parsed):
        for grp in items:
            for kind, s, m in grp:
                if s >= S:
                    raise ScheduleError(f"rank {r}: action {s}{kind}{m} names stage {s}, outside 0..{S - 1}")
                if m >= N:
                    raise ScheduleError(f"rank {r}: action {s}{kind}{m} names micro-batch {m}, outside 0..{N - 1}")
                if rank_of.setdefault(s, r) != r:
                    raise ScheduleError(f"stage {s} runs on rank {rank_of[s]} and rank {r}; "
                                        f"a stage must live on one rank")
    missing = [s for s in range(S) if s not in rank_of]
    if missing:
        raise ScheduleError(f"stages {missing} never run; the order covers stages {sorted(rank_of)}")
    order_out, full, overlapped = [], [], []
    for items in parsed:
        ops = []
        for grp in items:
            keys = []
            for kind, s, m in grp:
                if kind == "F":
                    ops.append((F, m, 0, s))
                    keys.append((F, s, m))
                elif kind == "I":
                    ops.append((B, m, 0, s))
                    keys.append((B, s, m))
                elif kind == "W":
                    ops.append((W, m, 0, s))
                    keys.append((W, s, m))
                else:  # full backward
                    ops.append((B, m, 0, s))
                    keys.append((B, s, m))
                    if split:
                        ops.append((W, m, 0, s))
                        full.append((s, m))
            if len(grp) == 2:
                overlapped.append(tuple(keys))
        order_out.append(ops)
    meta = {"source": "torch"}
    if full:
        meta["full_backward"] = full
    if overlapped:
        meta["overlapped"] = overlapped
    placement = [[rank_of[s] for s in range(S)]]
    return make_schedule(name, D, N, placement, order_out, split_backward=split, meta=meta)
