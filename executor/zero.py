"""ZeRO 1, 2 and 3 (FSDP) and HSDP (``--zero 1|2|3``, ``--dp-shard S``, ``--reshard-after-forward``):
the training state sharded over the ranks that hold a stage.

A stage's group (``schedule.stage_group(stage)``: its data-parallel replicas and model copies, k =
R x m ranks, m the devices one replica holds it on; with tensor parallelism the same TP rank of
each) is cut into *shard groups* of S x m ranks, S = ``dp_shard`` replicas (0: all R, plain ZeRO /
FSDP): replicas ``g S .. g S + S - 1`` shard together, torchtitan's ``[dp_replicate, dp_shard]``
mesh with the shard dimension fastest. With S < R (HSDP) the R / S shard groups replicate each
other: the rank at position i of each shard group forms a *replicate group*. Each stage module's
parameters are seen as one flat vector of n elements padded to S' x ``per``, ``per`` = ceil(n / S'),
S' = S x m the shard group's size; a rank owns the slice ``[i per, (i + 1) per)``: its fp32 master
copy with the optimizer state (Adam's two moments, SGD's momentum) of that slice alone.

What each stage keeps per rank, n parameters of 4 bytes (fp32), Adam:

========  =====================  ===================  ===============  ==============================
ZeRO      weights at rest        gradients            optimizer state  transient
========  =====================  ===================  ===============  ==============================
1         4 n (a flat buffer)    4 n                  8 per            --
2         4 n                    4 per (the slice)    8 per            4 n: one micro-batch's
                                                                       unsharded gradients, from its
                                                                       B to its reduce-scatter
3         4 per (the master)     4 per                8 per            the above, and 4 S' per
                                                                       gathered weights (below)
========  =====================  ===================  ===============  ==============================

(``RunResult.per_device``: ``static_bytes`` = weights, gradients and optimizer state,
``grad_buffer_bytes`` the largest unsharded gradient one reduce-scatter sent (a module's, n of it),
``gathered_bytes`` the peak of the gathered weights.)

The collectives, per step, per stage module of a rank (the op that issues them in brackets):

- ZeRO 1 [ALLREDUCE]: a reduce-scatter of the summed gradients over the shard group (each rank
  receives the sum of its slice: ``per`` elements of the S' ``per`` sent) in place of the
  all-reduce, as Megatron's distributed optimizer does.
- ZeRO 2 and 3 [B, or W in a split backward]: each micro-batch's gradients of the module are
  reduce-scattered as soon as its backward completes them, added into the rank's slice, and the
  unsharded gradients dropped (DeepSpeed's ZeRO-2; the simulator's ledger counts the gradients at
  1/S for it): N_m reduce-scatters per step, N_m the module's micro-batches (its B ops). The
  reduce-scatter is started asynchronously and waited for when the next one starts or at OPTIM.
  ALLREDUCE sends what is left: nothing. (torchtitan's pipelined FSDP instead accumulates the
  unsharded gradients over the micro-batches and reduce-scatters once, after the last backward:
  1/N_m of the traffic, 4 n bytes held through the step.)
- HSDP [OPTIM]: the slice all-reduced over the replicate group (R / S ranks), once.
- ZeRO 1 and 2 [OPTIM]: the updated slices all-gathered into the weights' flat buffer: one
  all-gather of S' ``per`` elements. ZeRO 3 has no weights to update there: the next step gathers
  them from the updated masters.
- ZeRO 3, weights gathered once per step (default; Llama 3, torchtitan under pipelining): one
  all-gather before the module's first F of the step, kept until its last B, then freed: 1 per step.
  With ``--reshard-after-forward``: before every F and every B of the module (W needs no weights:
  ``dW = g^T x``), freed after each: F_m + B_m all-gathers per step, F_m = B_m the module's
  micro-batches (2 N per module of a one-chunk-per-device schedule; interleaved chunks each count
  their own). The gathers run inside their F / B (the trace has one row per op of the lowered
  schedule, the gather's time inside the op's row) and are not overlapped with compute on gloo.

So per step and module: reduce-scatters 1 (ZeRO 1) or N_m (ZeRO 2, 3); all-gathers 1 (ZeRO 1, 2, and
3 default) or F_m + B_m = 2 N_m (ZeRO 3 resharded); all-reduces 1 with HSDP (R > S), else 0. Bytes:
an all-gather and a reduce-scatter each move S' ``per`` elements of 4 bytes through the group ((S' -
1) ``per`` per rank on a ring); the HSDP all-reduce ``per`` elements.

*The gathered weights.* ZeRO 3 keeps every parameter as a view of its module's flat buffer (as ZeRO-1
does) whose storage is resized to 0 when freed and back when gathered, so the tensors autograd
saved in F (a linear layer saves its weight for B) are the same objects in B and read the gathered
values, as FSDP2 does with its unsharded parameters. The all-gather writes through ``flat.data``
(its own version counter) so a re-gather between F and B is not an in-place change autograd
refuses. A resized storage has a new address: the activation meter and the recomputation, which
tell parameters from activations by storage address, are told (``watch``).

Why not torch's FSDP2 (``torch.distributed.fsdp.fully_shard``): tried on gloo (torch 2.13, a GPT
stage of 2 blocks, 2 ranks, each block and the stage ``fully_shard``-ed): with the full backward
its gradients equal the unsharded module's (0.0 apart), but with the split backward of
:mod:`executor.backward` (B, then W) the sharded parameters receive no gradient at all (0 of 27):
FSDP2 reduce-scatters in its post-backward hooks, which fire when the input gradient reaches the
module, i.e. in B; W computes the weight gradients later, outside the autograd engine, into the
unsharded parameters FSDP2 has by then resharded. ``torch.distributed.pipelining`` composes the two
only through FSDP2's private state (``set_requires_gradient_sync(False)`` for every backward, then
``fully_shard.state(m)._fsdp_param_groups[i].post_backward()`` and
``_root_post_backward_final_callback()`` after the last W, ``PipelineStage._post_backward``), and
its DTensor parameters would also have to be unwrapped at every seam of the executor the
tensor-parallel block lists (the flat gradient buffers, the saved-tensor meter's parameter
addresses, the recomputation, gathering the final parameters), with a new unsharded tensor per
gather. Our own sharding is this module: the same flat buffers as ZeRO-1, plus the gather.

The optimizers are element-wise, so stepping slices of a flat vector gives exactly the updates
of stepping the whole parameters (tests: losses and weights equal to the reference's).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .model import make_optimizer


@dataclass(frozen=True)
class ShardGroups:
    """Where one rank's shard of one stage sits: ``index`` of ``size`` ranks in the shard
    ``group`` (None: a group of one), and the ``replicate`` group (HSDP; None without) of
    ``replicas`` ranks."""

    group: object
    index: int
    size: int
    replicate: object = None
    replicas: int = 1


def shard_groups(stage_group: list[int], rank: int, replicas: int, dp_shard: int) -> tuple[tuple, tuple, int]:
    """(this rank's shard group, its replicate group, its index in the shard group) within a stage
    group of ``replicas`` x m ranks (sorted: replica-major, see the module docstring), ``dp_shard``
    S replicas per shard group (0: all)."""
    ranks = list(stage_group)
    m = len(ranks) // replicas
    s = (dp_shard or replicas) * m
    at = ranks.index(rank)
    g, i = divmod(at, s)
    shard = tuple(ranks[g * s:(g + 1) * s])
    replicate = tuple(ranks[k * s + i] for k in range(len(ranks) // s))
    return shard, replicate, i


class _Shard:
    def __init__(self, params: list, groups: ShardGroups, zero: int, counts: Counter, module=None):
        self.params, self.groups, self.zero, self.counts = params, groups, zero, counts
        self.module = module        # the stage module it shards (a module's dense and routed shards share it)
        self.group, self.index, self.size = groups.group, groups.index, groups.size
        self.numel = sum(p.numel() for p in params)
        self.per = math.ceil(self.numel / self.size)
        self.flat = self._padded([p.detach() for p in params])
        with torch.no_grad():      # the parameters live in the flat buffer from here on
            for p, part in zip(params, torch.split(self.flat[:self.numel], [p.numel() for p in params])):
                p.data = part.view_as(p)
        piece = self.flat[self.index * self.per:(self.index + 1) * self.per]
        # ZeRO 1, 2: a view of the weights; ZeRO 3: the only copy of the slice kept at rest
        self.master = torch.nn.Parameter(piece.clone() if zero == 3 else piece)
        self.received: torch.Tensor | None = None     # this step's reduce-scattered slice of the gradients
        self.outstanding = None     # ZeRO 2, 3: (work, slice) of the last micro-batch's reduce-scatter
        self.partial = torch.zeros(0, dtype=torch.long)   # positions in the slice of TP-partial gradients
        self.full_bytes = self.flat.numel() * self.flat.element_size()
        self.gathered = True
        self.watchers: list = []
        if zero == 3:
            self.free()

    def _padded(self, tensors) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.per * self.size - self.numel))

    def _moved(self, old: int) -> None:
        new = self.flat.untyped_storage().data_ptr()
        for w in self.watchers:
            w.param_storage_moved(old, new)

    # ------------------------------------------------------------------ ZeRO-3: the weights
    @torch.no_grad()
    def gather(self) -> None:
        """All-gather the weights of the module from the shard group's masters into the flat buffer."""
        if self.gathered:
            return
        old = self.flat.untyped_storage().data_ptr()
        self.flat.untyped_storage().resize_(self.full_bytes)
        self.gathered = True
        self._moved(old)
        target = self.flat.data      # its own version counter: not an in-place change of saved weights
        if self.size == 1:         # a group of one (EP's experts at EDP 1): a copy, no collective
            target.copy_(self.master.detach())
            return
        dist.all_gather_into_tensor(target, self.master.detach(), group=self.group)
        self.counts["all_gather"] += 1
        self.counts["all_gather_bytes"] += self.full_bytes

    def free(self) -> None:
        if not self.gathered:
            return
        old = self.flat.untyped_storage().data_ptr()
        self.flat.untyped_storage().resize_(0)
        self.gathered = False
        self._moved(old)

    # ------------------------------------------------------------------ gradients
    def mark_partial(self, ids: set[int]) -> None:
        """Positions, within this rank's slice, of the parameters in ``ids``."""
        pos, at = [], 0
        lo, hi = self.index * self.per, (self.index + 1) * self.per
        for p in self.params:
            if id(p) in ids:
                a, b = max(at, lo), min(at + p.numel(), hi)
                pos.extend(range(a - lo, b - lo))
            at += p.numel()
        self.partial = torch.tensor(pos, dtype=torch.long, device=self.flat.device)

    def grad_bytes(self) -> int:
        """Bytes of the unsharded gradients alive now (ZeRO 2, 3: from the first backward to ALLREDUCE)."""
        return sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)

    def reduce_scatter(self, flat: torch.Tensor):
        """ZeRO 1 at ALLREDUCE: launch the sum over the shard group of ``flat`` (this rank's gradients
        in the parameters' order), of which this rank receives its slice; the work (None on a group
        of one)."""
        self.received = torch.empty(self.per, dtype=flat.dtype, device=flat.device)
        return self._launch(flat, self.received)

    def _launch(self, flat: torch.Tensor, out: torch.Tensor):
        padded = torch.nn.functional.pad(flat, (0, self.per * self.size - self.numel))
        if self.group is None or self.size == 1:
            out.copy_(padded)
            return None
        self.counts["reduce_scatter"] += 1
        self.counts["reduce_scatter_bytes"] += padded.numel() * padded.element_size()
        return dist.reduce_scatter(out, list(padded.split(self.per)), group=self.group, async_op=True)

    def scatter_micro_batch(self, wait) -> int:
        """ZeRO 2, 3, once a micro-batch's gradients of the module are complete (after its B, or its
        W in a split backward): launch the reduce-scatter of the unsharded gradients and drop them;
        the slice is added to this step's ``received`` when the next one starts or at the step
        (``wait(work)``). Returns the bytes sent (0: no gradients)."""
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):
            return 0
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                          for g, p in zip(grads, self.params)])
        for p in self.params:
            p.grad = None
        self.settle(wait)
        piece = torch.empty(self.per, dtype=flat.dtype, device=flat.device)
        self.outstanding = (self._launch(flat, piece), piece)
        return self.per * self.size * flat.element_size()

    def settle(self, wait) -> None:
        """Wait for the outstanding micro-batch reduce-scatter and add its slice to ``received``."""
        if self.outstanding is None:
            return
        work, piece = self.outstanding
        self.outstanding = None
        if work is not None:
            wait(work)
        if self.received is None:
            self.received = piece
        else:
            self.received.add_(piece)

    def take_grad(self, wait=None) -> None:
        self.settle(wait)
        if self.received is not None:      # reduce-scattered: the slice is already summed
            self.master.grad, self.received = self.received, None
        else:                              # all-reduced (or one rank): the slice of the summed gradients
            g = self._padded([p.grad for p in self.params])
            self.master.grad = g[self.index * self.per:(self.index + 1) * self.per].clone()

    @torch.no_grad()
    def put_weights(self) -> None:
        """ZeRO 1, 2: the updated slices all-gathered into the weights (ZeRO 3 gathers before its next F)."""
        if self.zero == 3:
            return
        if self.size > 1:
            parts = [torch.empty_like(self.master) for _ in range(self.size)]
            dist.all_gather(parts, self.master.detach(), group=self.group)
            for k, part in enumerate(parts):
                if k != self.index:
                    self.flat[k * self.per:(k + 1) * self.per].copy_(part)
            self.counts["all_gather"] += 1
            self.counts["all_gather_bytes"] += self.full_bytes

    def static_bytes(self) -> int:
        """Weights, gradients and optimizer-less bytes this shard keeps at rest (module docstring)."""
        elem = self.flat.element_size()
        weights = self.per * elem if self.zero == 3 else self.numel * elem
        grads = self.per * elem if self.zero >= 2 else self.numel * elem
        return weights + grads


class ShardedOptimizer:
    """The optimizer ``name`` over the shards of ``stages``: ``[(params, ShardGroups)]``, one entry
    per distinct stage module of this rank, or ``[(params, ShardGroups, module)]`` where a module has
    several shards (expert parallelism: its dense parameters over the stage's shard group, its routed
    experts over their EDP group; ``module`` any key equal for a module's shards); ``zero`` 1, 2 or 3
    (module docstring). ``partial``:
    (parameters, TP group) whose gradients are partial sums over the TP group.
    ``reshard_after_forward`` (ZeRO 3): gather the weights for each F and B."""

    def __init__(self, stages, name: str, lr: float, *, zero: int = 1, reshard_after_forward: bool = False,
                 partial=None, timeout: float = 60.0, rank: int = 0):
        self.zero, self.reshard = zero, reshard_after_forward
        self.counts: Counter = Counter()      # collectives issued (and bytes through them), run so far
        self.shards = [_Shard(e[0], e[1], zero, self.counts, e[2] if len(e) > 2 else k)
                       for k, e in enumerate(stages) if e[0]]
        self.inner = make_optimizer([s.master for s in self.shards], name, lr)
        # a parameter -> its shard: with expert parallelism a stage module has two (its dense parameters
        # over the stage's shard group, its routed experts over their EDP group)
        self._by_param = {id(p): s for s in self.shards for p in s.params}
        self.timeout, self.rank = timeout, rank
        self.tp_group = None
        self.peak_gathered = 0          # bytes of gathered weights alive at once, the run's peak
        self.peak_grad_buffer = 0       # bytes of unsharded gradients alive at once (ZeRO 2, 3)
        self._left: dict = {}           # shard -> backward ops left in this step (ZeRO 3, gathered once)
        if partial is not None:
            params, self.tp_group = partial
            for s in self.shards:
                s.mark_partial({id(p) for p in params})

    def watch(self, *watchers) -> None:
        """Tell ``watchers`` (``param_storage_moved(old, new)``: the activation meter, the
        recomputation) where the gathered weights' storages move."""
        for s in self.shards:
            s.watchers.extend(w for w in watchers if hasattr(w, "param_storage_moved"))

    def _shards(self, params) -> list[_Shard]:
        """The shards holding ``params`` (a module's parameters, or a stage's summed ones), in the
        optimizer's order: the same on every rank of a group."""
        mine = {id(s) for p in params if (s := self._by_param.get(id(p))) is not None}
        return [s for s in self.shards if id(s) in mine]

    def _shard(self, params) -> _Shard | None:
        """ZeRO 1's one shard of a stage's all-reduced parameters (the routed experts, summed at OPTIM,
        are not among them)."""
        return self._by_param.get(id(params[0])) if params else None

    # ------------------------------------------------------------------ ZeRO-3: around F and B
    def plan_step(self, backwards: dict) -> None:
        """ZeRO 3 gathered once per step: ``backwards`` maps a module's first parameter's id to the
        number of B ops of the step that run it (after its last, the weights are freed); a module's
        shards (dense, routed experts) each count its B ops."""
        self._left = {}
        for first, n in backwards.items():
            owner = self._by_param.get(first)
            for s in self._module_shards(owner):
                self._left[s] = n

    def _module_shards(self, owner: _Shard | None) -> list[_Shard]:
        """The shards of the module ``owner`` (the shard of its first parameter) belongs to."""
        if owner is None:
            return []
        return [s for s in self.shards if s.module == owner.module]

    def before(self, params, kind: str) -> None:
        """Before an F or B of the module whose parameters are ``params``: gather its weights (ZeRO 3)."""
        if self.zero != 3:
            return
        for s in self._shards(params):
            s.gather()
        live = sum(x.full_bytes for x in self.shards if x.gathered)
        self.peak_gathered = max(self.peak_gathered, live)

    def after(self, params, kind: str) -> None:
        """After an F or B: free the weights when resharded after each op, or after the last B."""
        if self.zero != 3:
            return
        for s in self._shards(params):
            if self.reshard:
                s.free()
            elif kind == "B":
                self._left[s] -= 1
                if self._left[s] <= 0:
                    s.free()

    def gather_all(self) -> None:
        """ZeRO 3: every module's weights gathered (to read the final parameters); no-op otherwise."""
        if self.zero == 3:
            for s in self.shards:
                s.gather()

    # ------------------------------------------------------------------ gradients and the step
    def reduce_scatter(self, params: list, flat: torch.Tensor):
        """ZeRO 1, at the stage's ALLREDUCE: for the stage module whose parameters are ``params``,
        launch the reduce-scatter of its gradients ``flat`` and return ``(True, work)``; ``(False,
        None)`` for a module without a shard here (no parameters)."""
        shard = self._shard(params)
        if shard is None:
            return False, None
        return True, shard.reduce_scatter(flat)

    def _wait(self, work) -> None:
        from .p2p import wait_work
        wait_work(work, self.timeout, f"rank {self.rank}: reduce-scatter of a ZeRO-{self.zero} shard's gradients")

    def grads_ready(self, params: list) -> None:
        """ZeRO 2, 3: a micro-batch's gradients of the module whose parameters are ``params`` are
        complete (after its B, or its W in a split backward): reduce-scatter them, drop them."""
        shards = self._shards(params)
        self.peak_grad_buffer = max(self.peak_grad_buffer, sum(s.grad_bytes() for s in shards))
        for shard in shards:
            shard.scatter_micro_batch(self._wait)

    def flush(self, params: list) -> int:
        """ZeRO 2, 3, at the stage's ALLREDUCE: reduce-scatter what gradients are left (none when every
        backward reported :meth:`grads_ready`); the bytes sent. ``params``: the stage's all-reduced
        parameters, so the routed experts' shard (reduce-scattered over its EDP group at each B) is
        not flushed here but at the step (:meth:`step`)."""
        return sum(s.scatter_micro_batch(self._wait) for s in self._shards(params))

    @property
    def state(self) -> dict:
        """Per shard: its optimizer state (what the optimizer keeps per rank; the shard itself is a
        view of the weights under ZeRO 1 and 2)."""
        return {s.master: dict(self.inner.state.get(s.master, {})) for s in self.shards}

    def static_bytes(self) -> int:
        """Weights, gradients and optimizer state this rank keeps at rest (module docstring)."""
        n = sum(s.static_bytes() for s in self.shards)
        for state in self.inner.state.values():
            n += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return n

    def step(self) -> None:
        from .p2p import wait_work
        pending = []
        for s in self.shards:
            s.take_grad(self._wait)
            if self.tp_group is not None and s.partial.numel():
                part = s.master.grad[s.partial]
                pending.append((s, part, dist.all_reduce(part, group=self.tp_group, async_op=True)))
        for s, part, work in pending:
            wait_work(work, self.timeout, f"rank {self.rank}: all-reduce of the sequence-parallel norm "
                                          f"gradients of a ZeRO shard over the tensor-parallel group")
            s.master.grad[s.partial] = part
        replicas = []
        for s in self.shards:          # HSDP: the slices summed over the replicate group
            if s.groups.replicas > 1:
                self.counts["all_reduce"] += 1
                self.counts["all_reduce_bytes"] += s.master.grad.numel() * s.master.grad.element_size()
                replicas.append(dist.all_reduce(s.master.grad, group=s.groups.replicate, async_op=True))
        for work in replicas:
            wait_work(work, self.timeout, f"rank {self.rank}: all-reduce of a ZeRO shard's gradients over its "
                                          f"HSDP replicate group")
        self.inner.step()
        for s in self.shards:
            s.put_weights()

    def zero_grad(self, set_to_none: bool = False) -> None:
        for s in self.shards:
            s.master.grad = None
            s.received = s.outstanding = None
            for p in s.params:
                if self.zero >= 2:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
