"""Replica symmetry: when one simulated replica can stand for all R data-parallel replicas.

Replicas run the same program on their own ranks (``Schedule.program``), so with the same costs,
no slowdown that differs between them, no jitter and no shared host cores, they compute in
lockstep. What can still tell them apart is the network: a replica whose transfers cross a link
shared with another replica's, or a slower link, moves its bytes at other rates.

:func:`replica_classes` decides, and prepares the flows of the one-replica run. Every transfer
that can happen is a *copy* of a *class*: the SENDs of one device pair of replica 0 (one copy per
replica), the transfers of one phase of a stage's all-reduce (one copy per ring hop). A link's
load is how many copies of each class cross it. Classes are refined (split by the multiset of
(capacity, load) of the links each copy crosses, and its latency) until nothing splits: an
equitable partition. Then, whatever subset of classes is active, max-min fair sharing gives every
copy of a class the same rate (progressive filling raises them together and they meet the same
saturations), so a class is one flow over one resource per kind of link it crosses, with a weight
equal to the copies of the class on such a link. Links that can never limit a rate (a fabric uplink
wide enough for everything that may cross it, or for all the NICs below it can send) are left out
first. If the SENDs of some device pair split, a
replica meets other links or contention than replica 0: the placement is not symmetric. Replicas
whose SENDs fall in the same classes, pair by pair, are still alike (a *kind*): every class of
SENDs is then one device pair of one kind, so one replica of each kind is simulated (each of its
transfers a flow standing for its kind's copies, the all-reduces as before) and stands for the
others of its kind, by the same argument: the copies of a class start together and get the same
rate, so alike replicas stay in lockstep. Only when every replica is a kind of its own does the
engine simulate every replica (e.g. D = 12 on 8-GPU nodes: replicas 0 and 2 on 8 + 4 GPUs, 1 and
3 on 4 + 8, two kinds).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.comm import allreduce_phases
from schedules.ir import SEND


REFINE_WORK = 4_000_000
"""Transfer signatures the refinement of :func:`replica_classes` computes at most (passes x
transfers) before it gives up on symmetry and every replica is simulated (the simulator's op limit
then refuses a run too big for that at once)."""


@dataclass
class Symmetry:
    """Flows of a run of one replica per kind: ``p2p[(a, b)]`` = (resources, latency) of a transfer
    from rank a to b of a simulated replica; ``allreduce[stage]`` = [(repeat, latency, [(resources,
    bytes, share)])]; ``rep_of[i]`` = the simulated replica that stands for replica i (the smallest
    of its kind; empty: replica 0 for all)."""

    p2p: dict = field(default_factory=dict)
    allreduce: dict = field(default_factory=dict)
    classes: int = 0
    rep_of: list = field(default_factory=list)


def symmetry_blocker(sched, costs, opts) -> str | None:
    """Why the replicas of ``sched`` cannot be simulated as one (None: nothing in the schedule,
    costs or options stops it; the network is checked by :func:`replica_classes`)."""
    D, R = sched.num_devices, sched.replicas
    if opts.exact:
        return "exact simulation asked for"
    if opts.jitter:
        return "per-op jitter makes replicas differ"
    if opts.hosts is not None:
        return "ranks share host cores"
    for r in opts.slowdown:
        want = opts.slowdown.get(r % D, 1.0)
        if any(opts.slowdown.get(r % D + i * D, 1.0) != want for i in range(R)):
            return f"rank {r}'s slowdown differs from its replicas'"
    kinds = costs.rank_kinds
    if kinds is not None:
        for r in range(D, R * D):
            if kinds[r] != kinds[r % D]:
                return f"rank {r} sits on another device kind than rank {r % D}"
    for what, vals in (("static memory", costs.static_mem), ("optimizer time", costs.optim_time)):
        for r in range(D, R * D):
            if vals[r] != vals[r % D]:
                return f"rank {r}'s {what} differs from rank {r % D}'s"
    return None


def _drop_idle_links(paths: list[tuple[tuple[str, ...], float]], cap: dict[str, float]):
    """Paths without the links that can never limit a rate: a link inside paths (never a path's
    first or last link) that can carry everything its traffic can bring, either

    * because its capacity covers every copy crossing it running at the smaller capacity of its
      path's two end links (which stay, so no copy ever runs faster than that), or
    * because its capacity covers the sum of the capacities of the distinct first links (or of
      the distinct last links) of the paths crossing it: what crosses it first crossed one of
      those, so its constraint is implied by theirs. Max-min fair rates depend only on the set of
      feasible rates, which dropping an implied constraint leaves as it was, so every rate is the
      same with or without it. A non-blocking uplink (the ports of the NICs below it) is such a
      link however many copies cross it.

    Without it, copies that differ only in crossing it (a ring's hop between leaves) are alike."""
    ends = set()
    for names, _ in paths:
        if names:
            ends.add(names[0])
            ends.add(names[-1])
    demand: dict[str, float] = {}
    firsts: dict[str, set[str]] = {}
    lasts: dict[str, set[str]] = {}
    for names, _ in paths:
        if len(names) > 2:
            bound = min(cap[names[0]], cap[names[-1]])
            for n in names[1:-1]:
                demand[n] = demand.get(n, 0.0) + bound
                firsts.setdefault(n, set()).add(names[0])
                lasts.setdefault(n, set()).add(names[-1])

    def fed(n: str) -> float:
        return min(sum(cap[f] for f in firsts[n]), sum(cap[f] for f in lasts[n]))

    # a relative 1e-12: a link as wide as its ports (32 x 400 Gb/s summed or multiplied) is implied
    idle = {n for n, d in demand.items() if n not in ends and min(d, fed(n)) <= cap[n] * (1 + 1e-12)}
    if not idle:
        return paths
    return [(tuple(n for n in names if n not in idle), lat) for names, lat in paths]


def replica_classes(sched, costs, network, opts) -> tuple[Symmetry | None, str | None]:
    """(the flows of one replica per kind, why not one for all or None) when some replicas are alike
    (their transfers in the same classes, pair by pair), else (None, why)."""
    if network is None:
        return Symmetry(), None
    D, R = sched.num_devices, sched.replicas
    kinds: list[tuple] = []           # class -> ("p2p", (a, b)) or ("ar", stage, phase)
    copies: list[tuple[int, int, int]] = []   # (class, src, dst)
    pairs = sorted({(d, op.peer) for d in range(D) for op in sched.programs[d] if op.kind == SEND})
    for a, b in pairs:
        cid = len(kinds)
        kinds.append(("p2p", (a, b)))
        copies += [(cid, a + i * D, b + i * D) for i in range(R)]
    phases: dict[int, list] = {}
    if getattr(network, "collective", None) is None:
        for s in range(sched.num_stages):
            nbytes = costs.param_bytes[0][s]
            group = sched.stage_group(s)
            if nbytes <= 0 or len(group) <= 1:
                continue
            phases[s] = []
            for p, (repeat, transfers) in enumerate(allreduce_phases(network, group, nbytes)):
                cid = len(kinds)
                kinds.append(("ar", s, p))
                phases[s].append((repeat, cid, transfers[0][2] if transfers else 0.0))
                copies += [(cid, src, dst) for src, dst, _ in transfers]
    cap: dict[str, float] = {}
    cache: dict[tuple[int, int], tuple[tuple[str, ...], float]] = {}
    paths = []
    slow = opts.link_slowdown
    for _, a, b in copies:
        got = cache.get((a, b))
        if got is None:
            names, lat = [], 0.0
            for ln in network.path(a, b):
                if ln.name not in cap:
                    cap[ln.name] = ln.bandwidth / slow.get(ln.name, 1.0)
                names.append(ln.name)
                lat += ln.latency
            got = cache[(a, b)] = (tuple(names), float(f"{lat:.12g}"))
        paths.append(got)
    paths = _drop_idle_links(paths, cap)
    cls = [c for c, _, _ in copies]
    count = len(kinds)
    passes = 0
    while True:
        load: dict[str, dict[int, int]] = {}
        for c, (names, _) in zip(cls, paths):
            for n in names:
                d = load.get(n)
                if d is None:
                    d = load[n] = {}
                d[c] = d.get(c, 0) + 1
        colors: dict[tuple, int] = {}
        color_of = {n: colors.setdefault((cap[n], tuple(sorted(d.items()))), len(colors)) for n, d in load.items()}
        sigs: dict[tuple, int] = {}
        new = [sigs.setdefault((c, lat, tuple(sorted(color_of[n] for n in names))), len(sigs))
               for c, (names, lat) in zip(cls, paths)]
        if len(sigs) == count:
            break
        passes += 1
        if passes * len(cls) > REFINE_WORK:
            # a split that travels around rings one hop per pass (pods that cut the rings where the
            # pipeline's stages do not line up with them) ends with every replica of its own kind:
            # no use waiting for it
            return None, (f"the transfer classes still split after {passes} passes over {len(cls):,} transfers "
                          f"(replicas alike in few kinds or none)")
        count, cls = len(sigs), new
    # replicas whose transfers are in the same classes, pair by pair, are of one kind: one of each
    # kind is simulated (every class of SENDs is then one device pair of one simulated replica)
    sig: list[list[int]] = [[] for _ in range(R)]
    why = None
    for i, (c0, a, b) in enumerate(copies):
        if kinds[c0][0] == "p2p":
            sig[a // D].append(cls[i])
            if why is None and cls[i] != sig[0][len(sig[a // D]) - 1]:
                why = (f"replica {a // D}'s transfers from rank {a} to rank {b} meet other links or contention "
                       f"than replica 0's (placement not symmetric)")
    kind_rep: dict[tuple, int] = {}
    rep_of = [kind_rep.setdefault(tuple(x), i) for i, x in enumerate(sig)]
    if len(kind_rep) == R and R > 1:
        return None, why
    if len(kind_rep) > 1:
        # exact only if every class of SENDs lies within one kind: a class's flows carry the load of
        # all its copies, so two simulated replicas with a pair in one class would count it twice
        # (kinds that differ on some pairs can still share the class of another, e.g. a slowed link
        # on one pair's path that the other pairs' links do not meet)
        kinds_of: dict[int, set[int]] = {}
        for i, (c0, a, _) in enumerate(copies):
            if kinds[c0][0] == "p2p":
                kinds_of.setdefault(cls[i], set()).add(rep_of[a // D])
        if any(len(k) > 1 for k in kinds_of.values()):
            return None, why + "; replicas of different kinds share a class of transfers"
    rep: dict[int, int] = {}
    for i, c in enumerate(cls):
        rep.setdefault(c, i)

    def resources(c: int):
        names, lat = paths[rep[c]]
        seen, out = set(), []
        for n in names:
            col = color_of[n]
            if col not in seen:
                seen.add(col)
                out.append((f"sym{col}", (cap[n], float(load[n][c]))))
        return out, lat

    sym = Symmetry(classes=count, rep_of=rep_of if len(kind_rep) > 1 else [])
    for (c0, a, b), c in zip(copies, cls):
        if kinds[c0][0] == "p2p" and rep_of[a // D] == a // D and (a, b) not in sym.p2p:
            sym.p2p[(a, b)] = resources(c)
    members: dict[int, list[int]] = {}
    for i, (c0, _, _) in enumerate(copies):
        if kinds[c0][0] == "ar":
            members.setdefault(c0, []).append(i)
    for s, plist in phases.items():
        out = []
        for repeat, c0, nb in plist:
            idx = members.get(c0, [])
            finals = sorted({cls[i] for i in idx})
            lat = max((paths[i][1] for i in idx), default=0.0)
            flows = []
            for c in finals:
                res, _ = resources(c)
                flows.append((res, nb, 1.0))
            out.append((repeat, lat, flows))
        sym.allreduce[s] = out
    return sym, (why + f"; one of each of {len(kind_rep)} kinds of alike replicas simulated" if why else None)
