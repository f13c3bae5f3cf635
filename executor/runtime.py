"""The interpreter: one rank walks its lowered program, op by op, for one optimizer step.

Per op kind (the IR's semantics, :mod:`schedules.ir` / :mod:`schedules.validate`):

F     forward of one chunk (a stage module) for one micro-batch, under the run's precision
      (:mod:`executor.precision`: fp32, or bf16 autocast) and with its layers' recomputation
      hooks (:mod:`executor.recompute`); under ZeRO 3 after the module's weights are all-gathered
      (at its first F of the step, or at every F and B with ``--reshard-after-forward``; freed
      after its last B, or after each op: :mod:`executor.zero`). Its input is the token ids
      (stage 0) or the activation
      a RECV or COPY delivered; the output is kept with the input for backward, and a detached
      copy (in the precision's wire dtype) is handed to the SEND/COPY that follows. On the last stage
      the output is the loss of the micro-batch divided by G = R * N (the number of
      micro-batches in the global batch), so that summing gradients over micro-batches, model
      copies and replicas gives exactly the gradient of the mean loss of the global batch. A stage
      with MoE blocks adds their load-balancing loss (already in its graph, :mod:`executor.moe`)
      to the step's loss sum, on whichever stage it is.
B     backward of that chunk for that micro-batch, given the output gradient a RECV or COPY
      delivered (none on the last stage). A full backward accumulates the parameter gradients and
      produces the input gradient. In a split-backward schedule B computes only the input gradient
      and records what W needs, W later only the parameter gradients (:mod:`executor.backward`,
      one :class:`~executor.backward.SplitBackward` per stage module); the gradients B recorded
      count as activation memory until W. A first stage whose output depends on no parameter (a
      layer stack's ReLU, reshape or Identity: its input needs no gradient) has nothing to do in B.
W     weight-gradient half of a split backward (see B); frees the graph.
      A slowed rank (``slowdown`` k > 1: the job's ``--slowdown RANK=k``, the simulator's straggler,
      e.g. a slower pool's GPU emulated on this host) sleeps (k - 1) x the F, B or W it just ran,
      inside the op's trace row, so the op takes k times its measured time. A sleep, not a busy
      wait: a slower device keeps its host core free, and on a shared CPU host a busy wait would
      take cores from the other ranks and slow them too.
SEND  ``isend`` of the message produced by the F/B before it (see :mod:`executor.p2p`).
RECV  wait for the message posted ahead by the mailbox; activations become (fp32) leaves that
      require grad, so the following B yields their gradient.
COPY  same-rank hand-off (the V turn of a V-shaped placement): an activation is detached and
      made a leaf of the next stage's graph; a gradient is passed as is (both as they would
      travel: the same rounding as a SEND in bf16).
ALLREDUCE  sum the stage's parameter gradients over ``schedule.stage_group(stage)`` (the model
      copies and data-parallel replicas of the stage), started asynchronously on one flat buffer;
      local copies of the stage on this rank are summed into it first (copies that share one module
      have accumulated into the same gradients already). On gloo its trace row ends when the sum
      is ready (the future's completion), as in the simulator; on NCCL when it was launched.
      Under ZeRO-1 it is a reduce-scatter over the stage's shard group: this rank receives the sum
      of its shard only. ZeRO 2 and 3 reduce-scatter each micro-batch's gradients as soon as its B
      (W in a split backward) completes them, and drop them; ALLREDUCE sends what is left, nothing
      (:mod:`executor.zero`, with HSDP's all-reduce over the replicate group at OPTIM).
OPTIM wait for the step's all-reduces, write the sums back to every local copy, step the
      optimizer and zero the gradients. Every copy of a stage then holds the same weights.

Every op becomes one trace row (schema of :mod:`schedules.trace`): start/end on the rank's clock
(seconds since the aligned start; on CUDA compute ops synchronise before their end is read),
bytes moved for SEND/RECV/ALLREDUCE, and the activation bytes alive after the op.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from schedules.overlap import paired_backward
from schedules.ir import ACT, ALLREDUCE, COPY, GRAD, OPTIM, RECV, SEND, B, F, Op, Schedule, W, message_key
from schedules.trace import TraceRow

from .backward import SplitBackward, full_backward, weight_backward
from .data import TokenSource
from .device import DeviceContext
from .expert_parallel import arm_kill
from .faults import A2A, parse_fault
from .overlap import RetainedWeightGrad, Segment, backward_segments, forward_segments, input_grads, interleave, \
    is_tuple_segment, run_alone, steps_of, tuple_backward, tuple_input_backward
from .p2p import CommError, Mailbox, wait_work
from .precision import Precision
from .recompute import Recompute


@dataclass
class _StepState:
    """Tensors alive within one step, keyed by (copy, stage, micro-batch) or by message key."""

    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    inbox: dict = field(default_factory=dict)      # message key -> tensor delivered by RECV/COPY
    produced: dict = field(default_factory=dict)   # message key -> tensor for SEND/COPY
    pending_w: dict = field(default_factory=dict)  # (copy, stage, mb) -> (PendingWeightGrad, meter hold)
    batches: dict = field(default_factory=dict)    # global micro-batch -> (inputs, targets)
    allreduces: list = field(default_factory=list)
    ar_done: list = field(default_factory=list)     # per ALLREDUCE: [perf_counter at completion]
    accounted: dict = field(default_factory=dict)   # (copy, stage, mb) -> per segment, bytes of an unmetered F
    loss_sum: torch.Tensor | float = 0.0

    def leftovers(self) -> list[str]:
        out = []
        for name in ("inputs", "outputs", "inbox", "produced", "pending_w", "allreduces"):
            keys = [str(x[0]) for x in self.allreduces] if name == "allreduces" else list(getattr(self, name))
            if keys:
                out.append(f"{name}: {keys[:4]}")
        return out


@dataclass
class StepOutcome:
    rows: list[TraceRow]
    loss_sum: float
    peak_activation: int
    phases: list = field(default_factory=list)    # overlapped pairs' sub-phases (executor.overlap.Phase)


def slow_down(factor: float, t0: float, clock=time.perf_counter, sleep=time.sleep) -> float:
    """Sleep (factor - 1) x the time since ``t0`` (an op's start), so that the op ends ``factor`` times
    as late as it would have; returns the seconds asked of ``sleep``."""
    extra = (factor - 1.0) * (clock() - t0)
    sleep(extra)
    return extra


class PipelineRuntime:
    """Runs one rank's lowered program (see the module docstring).

    ``modules`` maps (copy, stage) to the stage modules this rank holds (already on its device);
    ``stage_groups`` maps a stage to its all-reduce process group (stages whose group is this rank
    alone are absent); ``clock0`` is this rank's ``perf_counter`` at the aligned start;
    ``precision`` the numeric precision, ``recompute`` the activation recomputation
    (``none|selective|full``, installed on the modules here). ``tied`` (a layer stack's parameters
    shared across stages, :class:`executor.user_model.TiedGradients`): those are left out of the
    stages' all-reduces and summed over their ranks at OPTIM; with sequence parallelism the same
    object sums the norms' gradients over the TP group there (after the stages' all-reduces).
    """

    def __init__(self, sched: Schedule, rank: int, *, modules: dict, optimizer: torch.optim.Optimizer,
                 data: TokenSource, ctx: DeviceContext, meter, mailbox: Mailbox, stage_groups: dict,
                 timeout: float, clock0: float, fault: str | None = None, precision: Precision | None = None,
                 recompute: str = "none", meter_every_forward: bool = False, tied=None, slowdown: float = 1.0):
        self.sched, self.rank = sched, rank
        self.slowdown = slowdown
        self.program = sched.program(rank)
        self.modules, self.optimizer, self.data = modules, optimizer, data
        self.ctx, self.meter, self.mailbox = ctx, meter, mailbox
        self.stage_groups, self.timeout, self.clock0 = stage_groups, timeout, clock0
        self.last_stage = sched.num_stages - 1
        self.G = sched.replicas * sched.num_microbatches
        self.mb_offset = (rank // sched.num_devices) * sched.num_microbatches
        self.local_copies: dict[int, list[int]] = {}
        for c, s in modules:
            self.local_copies.setdefault(s, []).append(c)
        self.fwd_bytes: dict[int, int] = {}   # stage -> activation bytes one micro-batch's F kept
        self.fault = _parse_fault(fault, rank)
        self.precision = precision or Precision()
        distinct = {id(m): m for m in modules.values()}
        lazy = recompute != "none"    # saved tensors exist only while B runs: W's inputs are taken then
        self.split = {key: SplitBackward(m.parameters(), lazy=lazy) for key, m in distinct.items()} \
            if sched.split_backward else {}
        self.recompute = Recompute(recompute, meter, [p for m in distinct.values() for p in m.parameters()])
        self.sample_memory = getattr(meter, "samples", False) and not meter_every_forward
        self.stage_bytes: dict = {}     # (copy, stage) -> bytes its metered forward (the run's first) kept
        self.seg_bytes: dict = {}       # (copy, stage, segments) -> per segment, bytes its metered forward kept
        self.accounted = 0              # bytes of the live unmetered forwards (see executor.device)
        self._peak = 0                  # the step's peak, sampled after each segment (see _sample)
        self._block_peak = 0            # the same within the op or pair running now
        for m in distinct.values():
            self.recompute.install(m)
        self.tied = tied
        self._skip = tied.excluded if tied is not None else frozenset()
        # ZeRO 3 (executor.zero): the optimizer gathers a module's weights around its F and B
        self._weights = optimizer if getattr(optimizer, "zero", 0) == 3 else None
        # ZeRO 2, 3: each micro-batch's gradients reduce-scattered once complete (after B, or W when split)
        self._sharded = optimizer if getattr(optimizer, "zero", 0) >= 2 else None
        self._params = {key: list(m.parameters()) for key, m in distinct.items()}
        self._backwards: dict[int, int] = {}      # id(a module's first parameter) -> its B ops per step
        for op in self.program:
            ps = self._params[id(modules[(op.copy, op.stage)])] if op.kind == B else None
            if ps:
                self._backwards[id(ps[0])] = self._backwards.get(id(ps[0]), 0) + 1
        self.step_index = 0
        self._state = _StepState()
        self._seg_split: dict = {}    # (id(module), segment) -> SplitBackward of a segmented forward's segment
        self.order = execution_order(self.program, sched.meta.get("overlapped", ()), rank)
        self._paired_b = {(b[1], b[2]) for _, b in sched.meta.get("overlapped", ())}   # (stage, mb) of paired B's
        self._handlers = {F: self._forward, B: self._backward, W: self._weight, SEND: self._send,
                          RECV: self._recv, COPY: self._copy, ALLREDUCE: self._allreduce, OPTIM: self._optim}

    # ------------------------------------------------------------------ one step
    def run_step(self, step: int) -> StepOutcome:
        self.step_index = step
        self._state = st = _StepState()
        self.meter.start_step()
        self.mailbox.start_step(step)
        if self._weights is not None:
            self._weights.plan_step(self._backwards)
        rows = []
        now = time.perf_counter
        peak = self._peak = self.meter.current() + self.accounted
        if self.fault is not None and self.fault[0] == A2A and self.fault[1] in (None, step):
            arm_kill()      # killed inside this step's first expert all-to-all (executor.faults)
        phases: list = []
        for item in self.order:
            ops = [self.program[i] for i in item]
            for op in ops:
                if self.fault is not None and self.fault[0] == str(op) and self.fault[1] in (None, step):
                    raise RuntimeError(f"injected fault: rank {self.rank} step {step} at {op}")
            t0 = now()
            self._block_peak = 0
            try:
                if len(ops) == 2:
                    phases += self._pair(*ops)
                    nbytes = 0
                else:
                    nbytes = self._handlers[ops[0].kind](ops[0])
            except CommError:
                raise
            except Exception as e:
                raise RuntimeError(f"rank {self.rank} step {step}: {' & '.join(map(str, ops))} failed: {e}") from e
            if ops[0].kind in (F, B, W):
                self.ctx.synchronize()
                if self.slowdown != 1.0:
                    slow_down(self.slowdown, t0)
            t1 = now()
            live = self.meter.current() + self.accounted
            if live > peak:
                peak = live
            # a pair: F spans the block and holds its peak (F's segments keep while B's free, so the block
            # can peak between its ends, as the simulator's pair F holds its own), B zero-length at its end
            mems = (max(self._block_peak, live), live) if len(ops) == 2 else (live,)
            for op, (a, b), mem in zip(ops, ((t0, t1), (t1, t1)), mems):
                rows.append(TraceRow(self.rank, step, len(rows), op.kind, str(op), op.copy, op.stage, op.chunk, op.mb,
                                     op.peer, a - self.clock0, b - self.clock0, float(nbytes), float(mem)))
            self.mailbox.top_up()
        self.mailbox.finish_step()
        self._allreduce_ends(rows, st.ar_done)
        left = st.leftovers()
        if left:
            raise RuntimeError(f"rank {self.rank} step {step}: the program left tensors unconsumed "
                               f"({'; '.join(left)}); every F needs its B (and W) and every message its consumer")
        loss = float(st.loss_sum)
        self._state = _StepState()
        return StepOutcome(rows, loss, int(max(peak, self._peak, self.meter.peak)), phases)

    # ------------------------------------------------------------------ compute
    def _batch(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.mb_offset + mb
        b = self._state.batches.get(g)
        if b is None:
            x, y = self.data.batch(self.step_index, g, self.G)
            b = self._state.batches[g] = (x.to(self.ctx.device), y.to(self.ctx.device))
        return b

    def _sample(self) -> None:
        """The step's peak after a segment of F or B: within an overlapped pair F's segments keep
        and B's release memory in turn, so the peak can fall between two op ends."""
        live = self.meter.current() + self.accounted
        self._block_peak = max(self._block_peak, live)
        if live > self._peak:
            self._peak = live

    def _forward(self, op: Op) -> int:
        # an F whose B runs in a pair runs cut into its segments even alone, so that B can interleave
        # them (a detach at a cut shares storage: the segments keep what the whole forward keeps)
        run_alone(self._forward_gen(op, segmented=(op.stage, op.mb) in self._paired_b))
        return 0

    def _backward(self, op: Op) -> int:
        run_alone(self._backward_gen(op))
        return 0

    def _pair(self, f: Op, b: Op) -> list:
        """An overlapped F&B pair (:mod:`executor.overlap`): F cut into segments, interleaved with B's
        segments (B walks its F's segments); returns the sub-phases."""
        _, _, phases = interleave(self._forward_gen(f, segmented=True), self._backward_gen(b), str(f), str(b),
                                  lambda: time.perf_counter() - self.clock0, self.ctx.synchronize)
        return phases

    def _forward_gen(self, op: Op, *, segmented: bool):
        """F as a generator (:func:`executor.overlap.forward_segments`): the stage module as one
        segment, or (``segmented``, in a pair) cut at its steps."""
        st = self._state
        key = (op.copy, op.stage, op.mb)
        module = self.modules[(op.copy, op.stage)]
        if op.stage == 0:
            x = self._batch(op.mb)[0]
        else:
            x = st.inbox.pop((ACT, op.copy, op.mb, op.stage - 1))
        where = (op.copy, op.stage)
        steps = steps_of(module, self.recompute) if segmented else [module]
        cut = where + (len(steps),)
        measure = not self.sample_memory or cut not in self.seg_bytes
        params = self._params[id(module)]
        if self._weights is not None:
            self._weights.before(params, F)
        kept: list[int] = []      # per segment: bytes metered, or (unmetered) accounted
        losses = []

        @contextlib.contextmanager
        def enter():      # one segment's compute: metered (F's segments only), under the precision
            before = self.meter.current()
            with self.meter.capture(measure), self.precision.autocast(self.ctx.device):
                yield
            if measure:
                kept.append(self.meter.current() - before)
            else:         # the same segment of the same module and shapes keeps what the metered one kept
                n = self.seg_bytes[cut][len(kept)]
                kept.append(n)
                self.accounted += n
            self._sample()

        def finish(out):
            losses.append(module.loss(out, self._batch(op.mb)[1]))
            return losses[0] / self.G

        segs = yield from forward_segments(steps, x, enter, finish if op.stage == self.last_stage else None)
        out = segs[-1].out
        if self._weights is not None:
            self._weights.after(params, F)
        if measure:
            self.seg_bytes[cut] = kept
            self.stage_bytes.setdefault(where, sum(kept))
        else:                    # released segment by segment by B (or W: see _backward_gen)
            st.accounted[key] = kept
        if op.stage not in self.fwd_bytes:
            self.fwd_bytes[op.stage] = self.stage_bytes[where]
        aux = getattr(module, "aux_loss", None)     # a mixture of experts' balance loss (executor.moe)
        if aux is not None:
            st.loss_sum = st.loss_sum + aux
        if op.stage == self.last_stage:
            st.loss_sum = st.loss_sum + losses[0].detach()
        else:
            st.produced[(ACT, op.copy, op.mb, op.stage)] = self.precision.to_wire(out)
        st.inputs[key] = x
        st.outputs[key] = segs

    def _backward_gen(self, op: Op):
        """B as a generator over its F's segments (:func:`executor.overlap.backward_segments`)."""
        st = self._state
        key = (op.copy, op.stage, op.mb)
        segs = st.outputs.pop(key)
        n_segs = len(segs)
        st.inputs.pop(key)
        grad = None if op.stage == self.last_stage else st.inbox.pop((GRAD, op.copy, op.mb, op.stage + 1))
        module = self.modules[(op.copy, op.stage)]
        params = self._params[id(module)]
        if self._weights is not None:
            self._weights.before(params, B)
        pendings, holds = [], []
        acc = st.accounted.pop(key, None)     # an unmetered F's bytes per segment, released as B frees them

        def release(i: int, pending=None):
            # a full backward frees the segment's graph; a split one too, but for what it keeps for W
            # (held exactly) -- unless it keeps the graph: a tuple segment's, or one B could not split
            if acc is not None and not (isinstance(pending, RetainedWeightGrad) or
                                        getattr(pending, "full", None) is not None):
                self.accounted -= acc[i]
                acc[i] = 0
            self._sample()

        def inp(i: int, seg: Segment):     # the segment's input, None where it is the token ids
            return seg.inp if i > 0 or op.stage > 0 else None

        if self.sched.split_backward:
            def run(i, seg, g):
                if is_tuple_segment(seg):
                    gx, pending = tuple_input_backward(seg, g, inp(i, seg) is not None, params)
                else:
                    gx, pending = self._split_of(module, i, n_segs).input(seg.out, inp(i, seg), g)
                pendings.append(pending)
                holds.append(self.meter.hold(pending.tensors()))    # what W keeps, from the segment's B on
                release(i, pending)
                return gx
        else:
            def run(i, seg, g):
                if is_tuple_segment(seg):
                    tuple_backward(seg, g)
                elif seg.out.requires_grad:   # else a first stage without parameters: nothing before it trains
                    full_backward(seg.out, g)
                gx = input_grads(seg, inp(i, seg) is not None)
                release(i)
                return gx

        gx = yield from backward_segments(segs, grad, run)
        del segs    # the segments' graphs: what B did not free (a first stage's token ids) goes now, as accounted
        if self.sched.split_backward:
            st.pending_w[key] = (pendings, holds)
            self._sample()
            if acc is not None and any(acc):     # the graphs B kept for W: released by W
                st.accounted[key] = acc
        if self._weights is not None:
            self._weights.after(params, B)
        if self._sharded is not None and not self.sched.split_backward:
            self._sharded.grads_ready(params)
        if op.stage > 0:
            st.produced[(GRAD, op.copy, op.mb, op.stage)] = self.precision.to_wire(gx)

    def _split_of(self, module, segment: int, segments: int) -> SplitBackward:
        """The SplitBackward of a module (unsegmented forward) or of one segment of it (each keeps
        its own graph template)."""
        if segments == 1:
            return self.split[id(module)]
        k = (id(module), segment)
        sb = self._seg_split.get(k)
        if sb is None:
            sb = self._seg_split[k] = SplitBackward(module.parameters(), lazy=self.recompute.mode != "none")
        return sb

    def _weight(self, op: Op) -> int:
        key = (op.copy, op.stage, op.mb)
        pendings, _held = self._state.pending_w.pop(key)
        for pending in pendings:
            if isinstance(pending, RetainedWeightGrad):
                pending.weight()
            else:
                weight_backward(pending)
        self.accounted -= sum(self._state.accounted.pop(key, ()))
        self._sample()
        if self._sharded is not None:
            self._sharded.grads_ready(self._params[id(self.modules[(op.copy, op.stage)])])
        return 0

    # ------------------------------------------------------------------ messages
    def _send(self, op: Op) -> int:
        t = self._state.produced.pop(message_key(op))
        self.mailbox.send(op, t)
        return t.numel() * t.element_size()

    def _recv(self, op: Op) -> int:
        t = self.mailbox.wait(op)
        nbytes = t.numel() * t.element_size()
        t = self.precision.from_wire(t)
        if op.payload == ACT:
            t.requires_grad_(True)
        self._state.inbox[message_key(op)] = t
        return nbytes

    def _copy(self, op: Op) -> int:
        st = self._state
        k = message_key(op)
        t = self.precision.from_wire(st.produced.pop(k))
        st.inbox[k] = t.detach().requires_grad_(True) if op.payload == ACT else t
        return 0

    # ------------------------------------------------------------------ gradients
    def _local_grads(self, stage: int) -> list[list[torch.Tensor]]:
        """The gradients of each distinct module of ``stage`` on this rank (copies may share one)."""
        mods = {id(m): m for m in (self.modules[(c, stage)] for c in self.local_copies[stage])}
        return [[p.grad for p in m.parameters() if id(p) not in self._skip] for m in mods.values()]

    def _stage_params(self, stage: int) -> list:
        """The parameters of ``stage``'s module on this rank (copies of a stage share one) that its
        ALLREDUCE sums (not those ``tied`` sums at OPTIM: routed experts over their EDP group)."""
        return [p for p in self.modules[(self.local_copies[stage][0], stage)].parameters() if id(p) not in self._skip]

    def _allreduce(self, op: Op) -> int:
        if self._sharded is not None:     # ZeRO 2, 3: reduce-scattered per micro-batch; what is left
            self._state.allreduces.append((op, None, None))
            self._state.ar_done.append([None])
            return self._sharded.flush(self._stage_params(op.stage))
        flat = self._summed_local_grads(op.stage)
        group = self.stage_groups.get(op.stage)
        scatter = getattr(self.optimizer, "reduce_scatter", None)   # ZeRO-1: each rank receives its slice
        scattered, work = scatter(self._stage_params(op.stage), flat) if scatter is not None else (False, None)
        if not scattered:
            work = dist.all_reduce(flat, group=group, async_op=True) if group is not None and flat.numel() else None
        self._state.allreduces.append((op, None if scattered else flat, work))
        done = [None]
        if work is not None and self.ctx.host_collectives and not scattered:
            # the transport's thread completes the future: its clock is when the sum was ready (gloo's
            # reduce-scatter has no future: its row spans the launch, as on NCCL)
            work.get_future().then(lambda _f, box=done: box.__setitem__(0, time.perf_counter()))
        self._state.ar_done.append(done)
        return flat.numel() * flat.element_size()

    def _optim(self, op: Op) -> int:
        done = set()
        for ar, flat, work in self._state.allreduces:
            if work is not None:
                wait_work(work, self.timeout, f"rank {self.rank} step {self.step_index}: {ar} over ranks "
                                              f"{self.sched.stage_group(ar.stage)}")
            if flat is not None:          # all-reduced: the sums go back into the gradients
                self._write_back(ar.stage, flat)
            done.add(ar.stage)
        self._state.allreduces = []
        for stage in self.local_copies:
            if stage in done:
                continue
            if len(self.sched.stage_group(stage)) > 1:
                raise RuntimeError(f"rank {self.rank}: stage {stage} is held by ranks {self.sched.stage_group(stage)} "
                                   f"but the program has no ALLREDUCE for it before OPT")
            if len(self._local_grads(stage)) > 1:   # separate modules of the stage here: sum them locally
                self._write_back(stage, self._summed_local_grads(stage))
        if self.tied is not None:
            self.tied.sync(self.timeout, self.step_index)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return 0

    def _allreduce_ends(self, rows: list[TraceRow], done: list[list]) -> None:
        """An ALLREDUCE row spans launch to completion (as the simulator's does) where the
        completion time is known; otherwise it spans the launch only."""
        it = iter(done)
        for i, row in enumerate(rows):
            if row.kind == ALLREDUCE:
                t = next(it)[0]
                if t is not None:
                    rows[i] = row._replace(end=max(row.end, t - self.clock0))

    def _summed_local_grads(self, stage: int) -> torch.Tensor:
        """The stage's gradients on this rank as one flat buffer, summed over its local modules."""
        copies = self._local_grads(stage)
        if not copies[0]:       # a stage without parameters (a layer stack's activation or pooling layers)
            return torch.zeros(0, device=self.ctx.device)
        flat = flatten(copies[0])
        for grads in copies[1:]:
            flat.add_(flatten(grads))
        return flat

    def _write_back(self, stage: int, flat: torch.Tensor) -> None:
        for grads in self._local_grads(stage):
            unflatten_into(flat, grads)


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new flat buffer holding ``tensors`` back to back (public-API equivalent of
    torch's private ``_flatten_dense_tensors``)."""
    return torch.nn.utils.parameters_to_vector(tensors)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy the consecutive slices of ``flat`` back into ``tensors`` (the inverse of :func:`flatten`;
    torch's ``vector_to_parameters`` would rebind ``.data`` instead of writing into the tensors)."""
    if not tensors:
        return
    for t, part in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def execution_order(program: list[Op], overlapped, rank: int) -> list[tuple[int, ...]]:
    """The order a rank runs its program in: one index per op, except that every overlapped pair
    (``meta["overlapped"]``: an F and the B right after it in the compute order) runs as one block
    ``(i, j)``, as the simulator runs it (:meth:`sim.engine._Engine._overlap`): the RECVs the
    program places between the two first, then the block, then the other ops between them (F's
    SEND / COPY: the block's outputs exist at its end)."""
    pairs = {tuple(a): tuple(b) for a, b in overlapped}
    out: list[tuple[int, ...]] = []
    n, i = len(program), 0
    while i < n:
        op = program[i]
        want = pairs.get((op.kind, op.stage, op.mb)) if op.kind == F else None
        if want is None:
            out.append((i,))
            i += 1
            continue
        j = paired_backward(program, i, want, rank)
        between = range(i + 1, j)
        out += [(x,) for x in between if program[x].kind == RECV]
        out.append((i, j))
        out += [(x,) for x in between if program[x].kind != RECV]
        i = j + 1
    return out


def _parse_fault(fault: str | None, rank: int):
    """``"RANK:TOKEN[:STEP]"`` (:func:`executor.faults.parse_fault`) -> (token, step or None) when it
    targets this rank."""
    if not fault:
        return None
    f = parse_fault(fault)
    return (f.token, f.step) if f.rank == rank else None
