"""Per-layer profiles in PipeDream's graph text format (DAPPLE's released profiles) as a layer chain.

The format (PipeDream's ``graph.txt``; DAPPLE ships its V100 profiles in it, see
``shared/data/dapple-profiles`` and the README there): one line per node::

    nodeK -- NAME -- forward_compute_time=MS, backward_compute_time=MS, activation_size=BYTES, parameter_size=BYTES

(``activation_size`` may be a list ``[A; B; ...]`` for a node with several outputs: their sum; an
optional ``-- stage_id=N`` is ignored), then one indented line per edge ``nodeA -- nodeB``. Times
are milliseconds for the batch the model was profiled at (the ``pbs-B`` in DAPPLE's file names),
sizes are bytes for that batch: ``activation_size`` is the node's output, ``parameter_size`` its
weights (fp32: 4 bytes per parameter).

Reading it as DAPPLE's planner (and PipeDream's before it) did:

* source nodes named ``Input...`` carry the data loader's time and size, not the model's: they are
  dropped (PipeDream zeroes and removes them); sinks named ``__getitem__...`` that nothing consumes
  are dropped too;
* the graph is a DAG; a planner over layer chains needs a chain, so the nodes are put in a
  topological order (Kahn's algorithm, ties in file order) and every node is a layer. A stage is a
  contiguous range of that order, and the tensors that cross the cut after layer i are the outputs
  of every earlier node consumed by a later one: ``out_bytes[i]`` is their total (what a stage
  ending at i sends onwards; a skip connection or an attention mask used by every layer crosses
  every cut, as in DAPPLE's antichain states);
* the activation memory a layer keeps for its backward is its output size (PipeDream's
  convention); the per-layer backward time is the profile's, with no input/weight-gradient split
  (all of it is the input-gradient backward B, W = 0).

:func:`load_pipedream_profile` reads and checks a file; :meth:`PipeDreamProfile.layer_costs` scales
the times, activations and boundary bytes linearly from the profile batch to a micro-batch, as
DAPPLE's planner does. Any malformed line, a non-finite or negative number, a missing node, a cycle
or a file without compute raises :class:`ProfileError` (a ValueError) naming the file and line.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..base import LayerCosts

PARAM_BYTES = 4.0           # the profiles are fp32: bytes per parameter
_FIELD = re.compile(r"\s*(forward_compute_time|backward_compute_time|activation_size|parameter_size)\s*=\s*"
                    r"(\[[^\]]*\]|[^,\s]+)\s*")
_PBS = re.compile(r"pbs-(\d+)")
FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


class ProfileError(ValueError):
    """A malformed profile file; the message names the file (and line) and what is wrong."""


@dataclass(frozen=True)
class ProfileNode:
    node_id: str
    name: str
    forward_ms: float
    backward_ms: float
    activation_bytes: float
    parameter_bytes: float
    line: int


@dataclass(frozen=True)
class PipeDreamProfile:
    """A profile as a chain of layers at ``profile_batch`` samples (seconds, bytes)."""

    name: str                         # file stem, e.g. bert-48-pbs-2
    path: str
    profile_batch: int
    layer_names: tuple[str, ...]
    node_ids: tuple[str, ...]
    f: tuple[float, ...]              # forward seconds at the profile batch
    b: tuple[float, ...]              # backward seconds at the profile batch
    act: tuple[float, ...]            # bytes kept for the backward at the profile batch
    out_bytes: tuple[float, ...]      # bytes crossing the cut after each layer at the profile batch
    param_bytes: tuple[float, ...]
    dropped: tuple[str, ...] = ()     # node ids left out (inputs, unused __getitem__ sinks)

    @property
    def num_layers(self) -> int:
        return len(self.f)

    @property
    def model(self) -> str:
        """The model name without the ``-pbs-B`` suffix (e.g. ``bert-48``)."""
        return _PBS.sub("", self.name).rstrip("-_")

    def merged(self) -> "PipeDreamProfile":
        """The chain with every node of zero compute and zero parameters (a view, a split, an add,
        a concat: PipeDream's profiles have many) merged into a neighbour: into the layer before it
        when the cut after it carries no more bytes than the cut before it (the cut moves past it),
        else into the layer after it. Fewer cut points for the planner; no cut it drops carries
        fewer bytes than the one kept beside it, and no cost is lost (times, parameters and
        activations of a merged layer are sums)."""
        groups: list[list[int]] = []
        pending: list[int] = []           # zero nodes waiting to join the next layer
        for i in range(self.num_layers):
            zero = self.f[i] == 0 and self.b[i] == 0 and self.param_bytes[i] == 0
            if zero and groups and not pending and self.out_bytes[i] <= self.out_bytes[groups[-1][-1]]:
                groups[-1].append(i)
            elif zero and i < self.num_layers - 1:
                pending.append(i)
            else:
                groups.append(pending + [i])
                pending = []
        if pending:
            groups[-1].extend(pending)
        pick = lambda xs, g: sum(xs[i] for i in g)  # noqa: E731
        return PipeDreamProfile(
            self.name, self.path, self.profile_batch,
            tuple("+".join(self.layer_names[i] for i in g) for g in groups),
            tuple("+".join(self.node_ids[i] for i in g) for g in groups),
            tuple(pick(self.f, g) for g in groups), tuple(pick(self.b, g) for g in groups),
            tuple(pick(self.act, g) for g in groups), tuple(self.out_bytes[g[-1]] for g in groups),
            tuple(pick(self.param_bytes, g) for g in groups), self.dropped)

    def layer_costs(self, micro_batch: float) -> LayerCosts:
        """Per-layer costs at ``micro_batch`` samples, scaled linearly from the profile batch."""
        if not (isinstance(micro_batch, (int, float)) and math.isfinite(micro_batch) and micro_batch > 0):
            raise ProfileError(f"{self.path}: the micro-batch must be a positive number; got {micro_batch!r}")
        q = float(micro_batch) / self.profile_batch
        sc = lambda xs: tuple(x * q for x in xs)  # noqa: E731
        zeros = (0.0,) * self.num_layers
        return LayerCosts(f=sc(self.f), b_input=sc(self.b), w=zeros, act=sc(self.act), act_w=zeros,
                          out_bytes=sc(self.out_bytes), params=tuple(p / PARAM_BYTES for p in self.param_bytes),
                          bytes_per_param_static=16.0, grad_bytes_per_param=PARAM_BYTES)


def profile_batch_from_name(path) -> int | None:
    """The ``B`` of a ``pbs-B`` in the file name, or None."""
    m = _PBS.search(Path(path).name)
    return int(m.group(1)) if m else None


def _number(text: str, where: str, field: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ProfileError(f"{where}: {field} must be a number; got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ProfileError(f"{where}: {field} must be a finite number >= 0; got {text!r}")
    return v


def parse_node(line: str, where: str, lineno: int) -> ProfileNode:
    parts = line.strip().split(" -- ")
    meta_at = next((i for i, p in enumerate(parts) if p.lstrip().startswith("forward_compute_time")), None)
    if len(parts) < 3 or meta_at is None or meta_at < 2:
        raise ProfileError(f"{where}: expected 'nodeK -- NAME -- forward_compute_time=..., "
                           f"backward_compute_time=..., activation_size=..., parameter_size=...'; got "
                           f"{line.strip()[:80]!r}")
    node_id, name, meta = parts[0].strip(), " -- ".join(parts[1:meta_at]).strip(), parts[meta_at]
    if not node_id or " " in node_id:
        raise ProfileError(f"{where}: bad node id {node_id!r}")
    vals: dict[str, float] = {}
    pos = 0
    for m in _FIELD.finditer(meta):
        if meta[pos:m.start()].strip(", ") != "":
            raise ProfileError(f"{where}: cannot read {meta[pos:m.start()].strip()!r} in the node's fields")
        key, raw = m.group(1), m.group(2)
        if key in vals:
            raise ProfileError(f"{where}: field {key} given twice")
        if raw.startswith("["):
            items = [x.strip() for x in raw[1:-1].split(";")]
            if not items or any(not x for x in items):
                raise ProfileError(f"{where}: {key} list {raw!r} must be numbers separated by '; '")
            vals[key] = sum(_number(x, where, key) for x in items)
        else:
            vals[key] = _number(raw.rstrip(","), where, key)
        pos = m.end()
    if meta[pos:].strip(", ") != "":
        raise ProfileError(f"{where}: cannot read {meta[pos:].strip()!r} in the node's fields")
    missing = [f for f in FIELDS if f not in vals]
    if missing:
        raise ProfileError(f"{where}: node {node_id} lacks {', '.join(missing)}")
    return ProfileNode(node_id, name, vals["forward_compute_time"], vals["backward_compute_time"],
                       vals["activation_size"], vals["parameter_size"], lineno)


def load_pipedream_profile(path, profile_batch: int | None = None) -> PipeDreamProfile:
    """Read a PipeDream/DAPPLE profile (see the module docstring). ``profile_batch``: the batch the
    file was profiled at (default: the ``pbs-B`` in the file name)."""
    p = Path(path)
    if p.is_dir():
        raise ProfileError(f"profile {p} is a directory; give a profile file (e.g. bert-48-pbs-2.txt)")
    if not p.is_file():
        raise ProfileError(f"profile file {p} does not exist")
    if profile_batch is None:
        profile_batch = profile_batch_from_name(p)
        if profile_batch is None:
            raise ProfileError(f"{p}: cannot tell the batch it was profiled at (no 'pbs-B' in the file name); "
                               f"give --profile-batch B")
    if isinstance(profile_batch, bool) or not isinstance(profile_batch, int) or profile_batch < 1:
        raise ProfileError(f"{p}: the profile batch must be a positive integer; got {profile_batch!r}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{p}: cannot read it as text ({e})") from None
    nodes: dict[str, ProfileNode] = {}
    order: list[str] = []
    edges: list[tuple[str, str, int]] = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{i}"
        if line[0] in " \t":
            toks = [t.strip() for t in line.strip().split(" -- ")]
            if len(toks) != 2 or not all(toks) or any(" " in t for t in toks):
                raise ProfileError(f"{where}: an edge line is 'nodeA -- nodeB' (indented); got {line.strip()[:80]!r}")
            edges.append((toks[0], toks[1], i))
            continue
        n = parse_node(line, where, i)
        if n.node_id in nodes:
            raise ProfileError(f"{where}: node {n.node_id} defined twice (first on line {nodes[n.node_id].line})")
        nodes[n.node_id] = n
        order.append(n.node_id)
    if not nodes:
        raise ProfileError(f"{p}: no nodes (is it a PipeDream graph profile?)")
    succ: dict[str, list[str]] = {n: [] for n in order}
    pred: dict[str, list[str]] = {n: [] for n in order}
    for a, b, i in edges:
        for x in (a, b):
            if x not in nodes:
                raise ProfileError(f"{p}:{i}: edge names node {x}, which is not defined")
        if b not in succ[a]:
            succ[a].append(b)
            pred[b].append(a)
    # drop inputs (sources named Input...) and unused __getitem__ sinks, as PipeDream does
    dropped = [n for n in order if not pred[n] and nodes[n].name.startswith("Input")]
    dropped += [n for n in order if not succ[n] and nodes[n].name.startswith("__getitem__") and n not in dropped]
    keep = [n for n in order if n not in dropped]
    gone = set(dropped)
    # topological order (Kahn), ties broken by file order
    rank = {n: k for k, n in enumerate(keep)}
    indeg = {n: sum(1 for x in pred[n] if x not in gone) for n in keep}
    ready = sorted((n for n in keep if indeg[n] == 0), key=rank.get)
    topo: list[str] = []
    import heapq
    heap = [(rank[n], n) for n in ready]
    heapq.heapify(heap)
    while heap:
        _, n = heapq.heappop(heap)
        topo.append(n)
        for m in succ[n]:
            if m in gone:
                continue
            indeg[m] -= 1
            if indeg[m] == 0:
                heapq.heappush(heap, (rank[m], m))
    if len(topo) != len(keep):
        stuck = [n for n in keep if n not in set(topo)]
        raise ProfileError(f"{p}: the graph has a cycle through node {stuck[0]} (line {nodes[stuck[0]].line})")
    if not topo:
        raise ProfileError(f"{p}: no layers left after dropping the input nodes")
    pos = {n: k for k, n in enumerate(topo)}
    # bytes crossing the cut after position k: outputs of nodes at <= k consumed at > k
    last_use = {n: max((pos[m] for m in succ[n] if m in pos), default=pos[n]) for n in topo}
    diff = [0.0] * (len(topo) + 1)
    for n in topo:
        a = nodes[n].activation_bytes
        if last_use[n] > pos[n]:
            diff[pos[n]] += a
            diff[last_use[n]] -= a
    out, run = [], 0.0
    for k in range(len(topo)):
        run += diff[k]
        out.append(max(run, 0.0))
    out[-1] = 0.0
    f = tuple(nodes[n].forward_ms * 1e-3 for n in topo)
    b = tuple(nodes[n].backward_ms * 1e-3 for n in topo)
    if sum(f) + sum(b) <= 0:
        raise ProfileError(f"{p}: every layer has zero compute time")
    return PipeDreamProfile(p.stem, str(p), profile_batch, tuple(nodes[n].name for n in topo), tuple(topo), f, b,
                            tuple(nodes[n].activation_bytes for n in topo), tuple(out),
                            tuple(nodes[n].parameter_bytes for n in topo), tuple(dropped))
