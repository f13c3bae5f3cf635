"""The backward pass as the runtime runs it: full, or split into its input-gradient half (B) and
its weight-gradient half (W) for zero-bubble schedules. One implementation, used by the runtime
(:class:`executor.runtime.PipelineRuntime`) and by calibration, which times exactly these calls.

- :func:`full_backward`: ``autograd.backward`` from the stage's output (with the gradient that
  arrived for it); parameter gradients accumulate, the input's gradient lands in ``x.grad``.
- :meth:`SplitBackward.input` (B): the gradient w.r.t. the stage's input, and nothing else. On
  the way it records, for every *parameterised op* -- an autograd node on the input's gradient
  path with an edge towards a parameter, e.g. the ``addmm`` of a linear layer or a layer norm --
  the gradient that arrived at it. Returns the input gradient and a :class:`PendingWeightGrad`.
- :meth:`SplitBackward.weight` (W): from each recorded op's saved inputs and the gradient
  recorded there, only its parameter side (``dW = g^T x``, ``db = sum g`` of a linear layer),
  accumulated into ``p.grad``. The activation-gradient chain is not run again.

Norms are the exception, as in the zero-bubble paper's implementation: a layer norm's two
per-channel parameters (an autograd function marked ``norm``, such as the Llama's RMS norm, alike)
get their gradients in B, from the same fused kernel that computes its input gradient (one kernel
instead of two, and nothing of it waits for W).

This is the technique of ``torch.distributed.pipelining``'s ``stage_backward_input`` /
``stage_backward_weight`` (``torch/distributed/pipelining/_backward.py``): find the nodes where
the weight subgraphs join the input's gradient path, capture the gradient arriving there in B,
and start W at those nodes. What differs, and why:

- *W without the autograd engine for the common ops.* PyTorch starts one ``autograd.grad`` per
  parameter group at the recorded nodes (``GradientEdge`` roots); each call costs a graph task
  (tens of microseconds) and groups with several nodes re-run the chain between them. Here a
  node whose parameter side is a plain parameter (seen through transposes and dtype casts, e.g.
  an autocast copy) and whose kind is ``addmm`` / ``mm`` / ``native_layer_norm`` / ``convolution`` gets its weight
  gradient from the node's saved inputs and the recorded gradient directly -- the same kernels
  the engine would run (``mm`` of the saved input and the gradient, the bias's sum), accumulated
  in place. So does the node of an autograd function that says how (``saved_for_weight(node)``
  and ``weight_grads(saved, grads)``, e.g. the sequence-parallel linears of
  :mod:`executor.tensor_parallel`, whose backward computes only what the running backward asks
  for). Any other parameterised node falls back
  to the engine, as in PyTorch: one call per group of nodes sharing a parameter, the nodes as
  ``GradientEdge`` roots and their parameters as the only inputs, so the engine runs only their
  parameter side; within a group, node pre-hooks clamp each node's incoming gradient to the one
  recorded in B (the chain between them runs again: the price of an unusual shared op, the sum is
  still exact).
- *Shared parameters* (a layer applied twice, tied weights, one autocast weight copy used twice):
  every use is its own node with its own recorded gradient, and the contributions are summed --
  exactly what the full backward computes, in a possibly different order of the sum.
- *The graph is analysed once per module.* A stage's forward builds the same graph every micro-
  batch. The first B walks it (which nodes depend on the input, which lead to parameters) and
  records, as a template, the path from the output to every parameterised node, the node's kind,
  its offset in autograd's sequence numbers and its parameters. Later B's follow those paths
  only (not the whole graph) and check kind and offset; any mismatch (a forward that took another
  branch) analyses afresh. The capture in B is then one engine call with the recorded nodes as
  extra ``GradientEdge`` inputs: no Python hook runs inside the backward.

*What lives from B to W.* Before its engine call B takes (detached) the saved inputs W's direct
recipes use -- a linear layer's input -- then runs without
``retain_graph``: the graph is freed as B goes, as in a full backward, and only those inputs and
the recorded gradients wait for W (the zero-bubble paper's M_W: the inputs of the linear layers
and the gradients of their outputs). Only when some op needs the engine in W is the graph kept
(``retain_graph``) until W. Gradients equal the full backward's up to the order of
floating-point sums.

*The first stage* (its input, token ids, needs no gradient; ``x`` None): the analysis roots at
the stage's first parameterised ops instead, the *sources* -- nodes none of whose inputs is an
activation and that are not a parameter seen through transposes and casts: the token and
position lookups (``EmbeddingBackward0``), a first linear layer or convolution of a float input.
B runs the backward down to the sources' outputs (every intermediate activation's gradient, the
blocks' recorded ops as on any stage), takes the gradients arriving there as extra engine inputs
and frees the graph as on any stage. A lookup's table gradient is computed in B right then, from
that gradient and its saved indices (``embedding_dense_backward``, the kernel of the full
backward), as zero-bubble runtimes leave the embedding in their backward: it has no FLOPs worth
deferring, and deferring it would keep the lookups' output gradients (bsh d) until W. Other
sources are recorded ops like any (W: a first linear layer's ``dW = g^T x``). So what waits for W
on the first stage is its blocks' M_W, as on any stage (:func:`cost_models.transformer.embedding_layer`
keeps nothing for W). A stage whose output depends on no parameter (``out.grad_fn`` None) has
nothing to do in either; one whose output is its input itself (a stage of ``nn.Identity``) passes
the gradient it was given on as its input's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge


try:   # the engine entry torch.autograd.backward / grad call after their argument checks
    from torch.autograd.graph import _engine_run_backward
except ImportError:    # pragma: no cover - older torch: the public functions
    _engine_run_backward = None


def _seed(out: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(out, memory_format=torch.preserve_format) if grad is None else grad


def full_backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``autograd.backward(out, grad)``. The runtime's tensors are its own (shapes and dtypes
    match by construction), so it goes straight to the engine: ``torch.autograd.backward``'s
    argument checks cost tens of microseconds per call, a tenth of a small stage's backward."""
    if _engine_run_backward is None:
        torch.autograd.backward(out, grad)
    else:
        _engine_run_backward((out,), (_seed(out, grad),), False, False, (), allow_unreachable=True,
                             accumulate_grad=True)


def _grad(out: torch.Tensor, inputs: tuple, grad: torch.Tensor | None, *, retain: bool) -> tuple:
    """``autograd.grad(out, inputs, grad, retain_graph=retain, allow_unused=True)`` (see full_backward)."""
    if _engine_run_backward is None:
        return torch.autograd.grad(out, inputs, grad, retain_graph=retain, allow_unused=True)
    return _engine_run_backward((out,), (_seed(out, grad),), retain, False, inputs, allow_unreachable=True,
                                accumulate_grad=False)


# ---------------------------------------------------------------------------- recorded ops
_ADDMM, _MM, _LN, _CONV, _EMB, _CUSTOM = "addmm", "mm", "layer_norm", "convolution", "embedding", "custom"
_FAST_KIND = {"AddmmBackward0": _ADDMM, "MmBackward0": _MM, "NativeLayerNormBackward0": _LN,
              "ConvolutionBackward0": _CONV, "EmbeddingBackward0": _EMB}
_PASS_THROUGH = {"TBackward0": True, "ToCopyBackward0": False}   # param-side nodes: name -> transposes


@dataclass
class _Op:
    """A parameterised op of the template: its kind, parameters and how to reach it."""

    node_type: type
    reg: int                            # where the replay program leaves the node (see _program)
    seq_offset: int                     # root's sequence number - node's (same forward: same offset)
    arity: int                          # gradients arriving at the node (its forward outputs)
    params: dict                        # id(param) -> param, those its parameter side reaches
    fast: tuple | None                  # direct weight-gradient recipe, or None (engine)
    in_b: bool = False                  # a norm: its (per-channel) parameter gradients come with B
    source: bool = False                # a first parameterised op of a first stage: B ends at it
    now: bool = False                   # a lookup there: its table gradient comes with B (see module doc)


@dataclass
class PendingWeightGrad:
    """What B keeps for W: per recorded op the gradients that arrived at it and either its saved
    inputs (ops with a direct recipe: the graph itself is not kept) or its node (ops the engine
    handles: the graph is kept), or, when B computed nothing, the output and its gradient (W then
    runs the whole backward)."""

    ops: list = field(default_factory=list)       # [(_Op, node or None, grads, saved inputs or None)]
    groups: list = field(default_factory=list)    # engine groups: lists of indices into ops
    full: tuple | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors B keeps for W (the gradients it recorded and the ops' saved inputs): the
        activation memory alive from B to W, beyond a retained graph's saved tensors."""
        out = []
        for _, _, grads, saved in self.ops:
            out += [g for g in grads if g is not None]
            if saved is not None:
                out += [t for t in saved if torch.is_tensor(t)]
        return out


class SplitBackward:
    """B and W of one stage module (or one layer, for calibration): see the module docstring.
    ``params`` are the parameters whose gradients W produces. ``lazy``: the module's saved
    tensors are recomputed during the backward (:mod:`executor.recompute`), so W's inputs are
    taken in node pre-hooks as B reaches each node, not all before B (which would recompute every
    layer of the stage at once)."""

    def __init__(self, params, *, lazy: bool = False):
        self.params = list(params)
        self.lazy = lazy
        self._ids = {id(p) for p in self.params}
        self._template = None        # ((first stage?, root type), replay program, ops, engine groups,
                                     # norm params) of the last analysed graph
        self.analyses = 0            # how often the graph was walked in full (tests, diagnostics)

    # ------------------------------------------------------------------ B
    def input(self, out: torch.Tensor, x: torch.Tensor | None,
              grad: torch.Tensor | None) -> tuple[torch.Tensor | None, PendingWeightGrad]:
        """B: the gradient w.r.t. ``x`` (None when ``x`` needs none) and what W needs."""
        if out.grad_fn is None:    # nothing before it trains (a first stage of parameter-free layers), or
            # the stage returns its input itself (an nn.Identity): the gradient passes through
            return (_seed(out, grad) if x is not None and out is x else None), PendingWeightGrad()
        if x is not None and not x.requires_grad:
            x = None                # token ids: the analysis roots at the first parameterised ops
        nodes = self._replay(out.grad_fn, x is None) if self._template is not None else None
        if nodes is None:
            return self._analyse_and_run(out, x, grad)
        _, _, ops, groups, in_b = self._template
        if self.lazy:
            return self._run_hooked(out, x, grad, ops, nodes, groups, in_b)
        kept = _keep_for_w(ops, nodes, groups)
        edges = [GradientEdge(n, k) for op, n in zip(ops, nodes) if not op.in_b for k in range(op.arity)]
        xs = () if x is None else (x,)
        got = _grad(out, (*xs, *edges, *in_b), grad, retain=bool(groups))
        _add_grads(in_b, got[len(xs) + len(edges):])
        gx, i = (got[0] if xs else None), len(xs)
        recorded = []           # one entry per op (engine groups index them); a norm's is empty
        for op, (node, saved) in zip(ops, kept):
            if op.in_b:
                recorded.append((op, None, (), None))
            else:
                recorded.append((op, node, got[i:i + op.arity], saved))
                i += op.arity
        return _input_grad(gx, x), PendingWeightGrad(_lookups_now(recorded), groups)

    def _analyse_and_run(self, out, x, grad):
        self.analyses += 1
        found = _analyse(out.grad_fn, x, self._ids)
        if found is None:       # out does not depend on x (or on a first parameterised op): W is all of it
            return _input_grad(None, x), PendingWeightGrad(full=(out, grad))
        paths, raw, sources = found
        root_seq = out.grad_fn._sequence_nr()
        program, regs = _program([paths[n] for n, _ in raw])
        ops = [_Op(type(node), reg, root_seq - node._sequence_nr(), 0, params, _fast_recipe(node),
                   source=node in sources) for (node, params), reg in zip(raw, regs)]
        groups = _engine_groups(ops)
        in_engine = {i for grp in groups for i in grp}
        in_b = {}
        for i, op in enumerate(ops):
            if op.fast is not None and op.fast[0] == _LN and i not in in_engine:
                op.in_b = True
                in_b.update({id(p): p for p in (op.fast[1], op.fast[3]) if p is not None})
            op.now = op.source and op.fast is not None and op.fast[0] == _EMB and i not in in_engine
        in_b = tuple(in_b.values())
        gx, pending = self._run_hooked(out, x, grad, ops, [node for node, _ in raw], groups, in_b)
        for op, (node, _), (_, _, grads, _) in zip(ops, raw, pending.ops):
            op.arity = len(node._input_metadata) if op.now else len(grads)    # (a lookup's record is empty)
        self._template = ((x is None, type(out.grad_fn)), program, ops, groups, in_b)
        return gx, pending

    def _run_hooked(self, out, x, grad, ops, nodes, groups, in_b):
        """B with node pre-hooks taking each op's incoming gradient (and, when lazy, its saved
        inputs) as the engine reaches it."""
        in_engine = {i for grp in groups for i in grp}
        eager = None if self.lazy else _keep_for_w(ops, nodes, groups)
        grads_at: list = [()] * len(ops)
        saved_at: list = [None] * len(ops)
        handles = []

        def hook(i, op, node, fetch):
            def pre(g):
                grads_at[i] = g
                if fetch:
                    saved_at[i] = _fetch(op, node)
            return pre
        # the first parameterised ops of a first stage (``x`` None) are where B ends: the engine
        # does not run them, so their incoming gradients are taken as extra inputs, not by hooks
        ends = [(i, k) for i, op in enumerate(ops) if op.source and not op.in_b
                for k in range(len(nodes[i]._input_metadata))] if x is None else []
        edges = [GradientEdge(nodes[i], k) for i, k in ends]
        xs = () if x is None else (x,)
        try:
            for i, (op, node) in enumerate(zip(ops, nodes)):
                if not op.in_b and not (x is None and op.source):
                    fetch = self.lazy and op.fast is not None and i not in in_engine
                    handles.append(node.register_prehook(hook(i, op, node, fetch)))
            got = _grad(out, (*xs, *edges, *in_b), grad, retain=bool(groups))
        finally:
            for h in handles:
                h.remove()
        for j, (i, k) in enumerate(ends):
            grads_at[i] = (*grads_at[i], got[len(xs) + j])
            if k == 0 and self.lazy and ops[i].fast is not None and i not in in_engine:
                saved_at[i] = _fetch(ops[i], nodes[i])     # not run by B: its saved inputs are intact
        _add_grads(in_b, got[len(xs) + len(edges):])
        recorded = []
        for i, (op, node) in enumerate(zip(ops, nodes)):
            if op.in_b:
                recorded.append((op, None, (), None))
            elif eager is not None:
                recorded.append((op, eager[i][0], tuple(grads_at[i] or ()), eager[i][1]))
            else:
                engine = i in in_engine or op.fast is None
                recorded.append((op, node if engine else None, tuple(grads_at[i] or ()), saved_at[i]))
        return _input_grad(got[0] if xs else None, x), PendingWeightGrad(_lookups_now(recorded), groups)

    def _replay(self, root, first: bool) -> list | None:
        """The template's nodes in this graph, following the recorded paths; None on a mismatch."""
        (was_first, root_type), program, ops, _, _ = self._template
        if type(root) is not root_type or was_first != first:
            return None
        regs = [root]
        push = regs.append
        try:
            for src, slot in program:
                push(regs[src].next_functions[slot][0])
        except IndexError:
            return None
        root_seq = root._sequence_nr()
        nodes = []
        for op in ops:
            node = regs[op.reg]
            if type(node) is not op.node_type or root_seq - node._sequence_nr() != op.seq_offset:
                return None
            nodes.append(node)
        return nodes

    # ------------------------------------------------------------------ W
    def weight(self, pending: PendingWeightGrad) -> None:
        """W: the parameter gradients of the ops B recorded, accumulated into ``p.grad``."""
        weight_backward(pending)


def weight_backward(pending: PendingWeightGrad) -> None:
    """W of a :class:`PendingWeightGrad` (see :meth:`SplitBackward.weight`)."""
    if pending.full is not None:
        out, grad = pending.full
        pending.full = None
        full_backward(out, grad)
        return
    ops = pending.ops
    with torch.no_grad():
        for op, _, grads, saved in ops:
            if saved is not None and op.fast[0] == _CUSTOM:
                for p, g in op.fast[1].weight_grads(saved, grads):
                    _accumulate(p, g)
            elif saved is not None and grads and grads[0] is not None:
                _direct(op.fast, saved, grads[0])
    for grp in pending.groups:
        roots, seeds, inputs = [], [], {}
        for i in grp:
            op, node, grads, _ = ops[i]
            for k, g in enumerate(grads):
                if g is not None:
                    roots.append(GradientEdge(node, k))
                    seeds.append(g)
            inputs.update(op.params)
        if not roots:
            continue
        handles = []
        if len(grp) > 1:   # nodes sharing a parameter: each starts from the gradient B recorded at it
            for i in grp:
                _, node, grads, _ = ops[i]
                handles.append(node.register_prehook(lambda _g, saved=grads: saved))
        try:
            torch.autograd.backward(roots, seeds, inputs=list(inputs.values()), retain_graph=True)
        finally:
            for h in handles:
                h.remove()
    pending.ops, pending.groups = [], []


def _lookups_now(recorded: list) -> list:
    """B's records with the lookups' table gradients computed now (from the gradient captured at
    each lookup and its saved indices: the kernel of the full backward) and nothing of them kept."""
    out = []
    with torch.no_grad():
        for op, node, grads, saved in recorded:
            if op.now:
                if grads and grads[0] is not None:
                    _direct(op.fast, saved, grads[0])
                out.append((op, None, (), None))
            else:
                out.append((op, node, grads, saved))
    return out


def _input_grad(gx, x):
    if x is None:
        return None
    return torch.zeros_like(x) if gx is None else gx


# ---------------------------------------------------------------------------- analysis
def _analyse(root, x: torch.Tensor | None, param_ids: set):
    """Walk the graph below ``root``: the nodes that depend on ``x`` and have a child that does not
    and leads to parameters (``[(node, {id: param})]`` in post-order), with a path from the root
    to each node (child slots), and the set of *sources*. None when ``root`` does not depend on ``x``.

    ``x`` None (a first stage: its input needs no gradient): the activations start at the sources,
    the nodes none of whose children depends on an activation and that are not a parameter seen
    through transposes and casts (an embedding lookup, a first linear layer of a float input). A
    source is recorded like a parameterised op and counts as depending on the input: B's gradients
    end at it, W computes its parameters' gradients."""
    input_node = x.grad_fn if x is not None else None
    sources = set()
    dep: dict = {}       # node -> depends on x
    reach: dict = {}     # node not depending on x -> {id(param): param} below it
    parent: dict = {root: None}   # node -> (parent node, slot) of its first discovery
    kids_of: dict = {}
    ops = []
    stack = [root]
    while stack:         # iterative post-order: a node is pushed again (in a tuple) to be finished
        item = stack.pop()
        if type(item) is tuple:
            node = item[0]
            kids = kids_of.pop(node)
            if any(dep[k] for k, _ in kids):
                dep[node] = True
                below = {}
                for k, _ in kids:
                    if not dep[k]:
                        below.update(reach[k])
                if below:
                    ops.append((node, below))
            else:
                below = {}
                for k, _ in kids:
                    below.update(reach[k])
                source = x is None and not (type(node).__name__ in _PASS_THROUGH and len(kids) == 1)
                dep[node] = source
                if source:
                    sources.add(node)
                    if below:
                        ops.append((node, below))
                else:
                    reach[node] = below
            continue
        if item in dep or item in kids_of:
            continue
        if input_node is not None and item is input_node:
            dep[item] = True
            continue
        kids = [(c, slot) for slot, (c, _) in enumerate(item.next_functions) if c is not None]
        if not kids:                                 # a leaf: x, a parameter or another leaf
            var = getattr(item, "variable", None)
            dep[item] = x is not None and var is x
            if not dep[item]:
                reach[item] = {id(var): var} if id(var) in param_ids else {}
            continue
        kids_of[item] = kids
        stack.append((item,))
        for c, slot in kids:
            if c not in dep and c not in kids_of:
                if c not in parent:
                    parent[c] = (item, slot)
                stack.append(c)
    if not dep.get(root):
        return None
    paths = {}
    for node, _ in ops:
        path, n = [], node
        while parent[n] is not None:
            n, slot = parent[n]
            path.append(slot)
        paths[node] = path[::-1]
    return paths, ops, sources


def _program(paths: list[list[int]]) -> tuple[tuple, list[int]]:
    """Paths (child slots from the root) as a straight-line program over registers: register 0 is
    the root, instruction i ``(src, slot)`` puts ``regs[src].next_functions[slot]`` in register
    i + 1; common prefixes are walked once. Returns the program and each path's register."""
    program, at = [], {(): 0}
    ends = []
    for path in paths:
        key = ()
        for slot in path:
            nxt = key + (slot,)
            if nxt not in at:
                program.append((at[key], slot))
                at[nxt] = len(program)
            key = nxt
        ends.append(at[key])
    return tuple(program), ends


def _engine_groups(ops: list[_Op]) -> list[list[int]]:
    """Ops that need the engine, in groups of ops sharing a parameter (transitively). A group of
    ops that all have a direct recipe needs no engine (each use adds its own contribution)."""
    owner: dict = {}
    groups: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        hit = {id(owner[p]) for p in op.params if p in owner}
        merged = [i] + [j for gid in hit for j in groups.pop(gid)]
        groups[id(merged)] = merged
        for j in merged:
            for p in ops[j].params:
                owner[p] = merged
    return [sorted(g) for g in groups.values() if any(ops[i].fast is None for i in g)]


def _param_chain(node):
    """(parameter, transposed) when ``node`` is a parameter's accumulator seen through transposes
    and dtype casts only; else None."""
    transposed = False
    while node is not None:
        nf = node.next_functions
        if not nf:
            var = getattr(node, "variable", None)
            return (var, transposed) if var is not None else None
        flip = _PASS_THROUGH.get(type(node).__name__)
        if flip is None or len(nf) != 1:
            return None
        transposed ^= flip
        node = nf[0][0]
    return None


def _fast_recipe(node):
    """How W gets this node's parameter gradients directly, or None (the engine does it)."""
    custom = getattr(type(node), "_forward_cls", None)
    if custom is not None and hasattr(custom, "weight_grads"):   # an autograd function that says how
        return (_CUSTOM, custom, False, None)
    kind = _FAST_KIND.get(type(node).__name__)
    if kind is None and getattr(custom, "norm", False):    # a norm written as an autograd function
        kind = _LN
    if kind is None:
        return None
    nf = [c for c, _ in node.next_functions]
    if kind == _ADDMM:
        if node._saved_alpha != 1 or node._saved_beta != 1 or nf[2] is None:
            return None
        w = _param_chain(nf[2])
        b = _param_chain(nf[0]) if nf[0] is not None else (None, False)
        if w is None or b is None or b[1] or (b[0] is not None and b[0].dim() != 1):
            return None
        return (_ADDMM, w[0], w[1], b[0])
    if kind == _EMB:      # a dense lookup of a plain parameter (a sparse gradient goes to the engine)
        w = _param_chain(nf[0]) if nf[0] is not None else None
        return None if w is None or w[1] or node._saved_sparse else (_EMB, w[0], False, None)
    if kind == _MM:
        w = _param_chain(nf[1]) if nf[1] is not None else None
        return None if w is None else (_MM, w[0], w[1], None)
    if kind == _CONV:     # weight (through dtype casts) and optional bias, both plain parameters
        w = _param_chain(nf[1]) if nf[1] is not None else None
        b = _param_chain(nf[2]) if len(nf) > 2 and nf[2] is not None else (None, False)
        if w is None or w[1] or b is None or b[1]:
            return None
        return (_CONV, w[0], False, b[0])
    wb = []
    for c in nf[1:3]:
        if c is None:
            wb.append(None)
        elif not c.next_functions and getattr(c, "variable", None) is not None:
            wb.append(c.variable)
        else:
            return None
    return (_LN, wb[0], False, wb[1] if len(wb) > 1 else None)     # (a norm without a bias)


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.to(p.dtype) if g.dtype != p.dtype else g
    else:
        p.grad.add_(g)


_ONES: dict = {}


def _ones(n: int, like: torch.Tensor) -> torch.Tensor:
    key = (n, like.dtype, like.device)
    v = _ONES.get(key)
    if v is None:
        v = _ONES[key] = torch.ones(n, dtype=like.dtype, device=like.device)
    return v


def _fetch(op: _Op, node) -> tuple:
    """The saved inputs of ``node`` that its direct recipe uses, detached (no history kept)."""
    kind = op.fast[0]
    if kind == _CUSTOM:
        return op.fast[1].saved_for_weight(node)
    if kind == _EMB:    # the indices, and what embedding_backward needs besides (not tensors)
        pad = node._saved_padding_idx      # -1 (none) reads back as its unsigned 64-bit value
        return (node._saved_indices.detach(), node._saved_weight_sym_argsize_0,
                pad - (1 << 64) if pad >= 1 << 63 else pad, node._saved_scale_grad_by_freq)
    if kind == _CONV:   # the input, and the geometry convolution_backward needs (not tensors)
        return (node._saved_input.detach(), node._saved_stride, node._saved_padding, node._saved_dilation,
                node._saved_transposed, node._saved_output_padding, node._saved_groups)
    saved = (node._saved_mat1 if kind == _ADDMM else node._saved_self,)
    return tuple(t.detach() for t in saved)


def _keep_for_w(ops: list[_Op], nodes: list, groups: list) -> list[tuple]:
    """Per op, what W will need, taken before B runs: (None, the saved inputs of its direct
    recipe) or (its node, None) when the engine handles it (the graph is then kept); a norm
    (gradients in B) needs nothing."""
    in_engine = {i for grp in groups for i in grp}
    out = []
    for i, (op, node) in enumerate(zip(ops, nodes)):
        if op.in_b:
            out.append((None, None))
        elif i in in_engine or op.fast is None:
            out.append((node, None))
        else:
            out.append((None, _fetch(op, node)))
    return out


def _add_grads(params: tuple, grads: tuple) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is not None:
                _accumulate(p, g)


def _direct(recipe, saved: tuple, g: torch.Tensor) -> None:
    """The parameter side of a recorded linear op from its saved input and the gradient ``g`` that
    arrived at it (the formulas of autograd's AddmmBackward0 / MmBackward0, accumulated in place:
    ``addmm_`` / ``addmv_`` where the dtypes allow, else the product is added)."""
    kind, w, transposed, b = recipe
    if kind == _CONV:
        _direct_conv(w, b, saved, g)
        return
    if kind == _EMB:      # the kernel of autograd's EmbeddingBackward0 (a dense table's gradient)
        indices, rows, padding_idx, by_freq = saved
        _accumulate(w, torch.ops.aten.embedding_dense_backward(g, indices, rows, padding_idx, by_freq))
        return
    (mat1,) = saved
    # out = mat1 @ mat2 -> d(mat2) = mat1^T g; the parameter is mat2, or mat2^T when transposed
    wg = w.grad
    if wg is not None and wg.dtype == g.dtype == mat1.dtype:
        if transposed:
            wg.addmm_(g.t(), mat1)
        else:
            wg.addmm_(mat1.t(), g)
    else:
        _accumulate(w, g.t().mm(mat1) if transposed else mat1.t().mm(g))
    if b is not None:
        bg = b.grad
        if bg is not None and bg.dtype == g.dtype:
            bg.addmv_(g.t(), _ones(g.shape[0], g))
        else:
            _accumulate(b, g.sum(0))


def _direct_conv(w: torch.Tensor, b: torch.Tensor | None, saved: tuple, g: torch.Tensor) -> None:
    """A convolution's weight and bias gradients only (``convolution_backward`` with the input's
    gradient masked off: the kernels the full backward runs for them)."""
    inp, stride, padding, dilation, transposed, output_padding, groups = saved
    weight = w.detach() if w.dtype == inp.dtype else w.detach().to(inp.dtype)   # read for its shape/dtype
    _, gw, gb = torch.ops.aten.convolution_backward(
        g, inp, weight, [w.shape[0]] if b is not None else None, list(stride), list(padding), list(dilation),
        transposed, list(output_padding), groups, [False, True, b is not None])
    _accumulate(w, gw)
    if b is not None:
        _accumulate(b, gb)


# ---------------------------------------------------------------------------- functional form
def input_backward(out: torch.Tensor, x: torch.Tensor | None, grad: torch.Tensor | None,
                   params) -> tuple[torch.Tensor | None, PendingWeightGrad]:
    """B without a template (analyses the graph every time): ``SplitBackward(params).input(...)``."""
    return SplitBackward(params).input(out, x, grad)
