"""``pipetwin plan`` on a mixed cluster (pools of several devices): :func:`planner.hetero.plan_mixed`,
the type-aware plan beside the type-blind one, both simulated on each stage's own device, and the
gain (``type-aware X s/step vs type-blind Y s/step: Gx``). ``--type-blind`` keeps the type-blind
plan as the answer (printed first, written with ``--out``)."""
from __future__ import annotations

from .common import print_json
from .options import DEFAULT_POLICIES, auto_values
from .plan_layout import LAYOUT_ONLY, given
from .tables import byte_unit, fmt_bytes, fmt_table, printable


def check_mixed_args(args) -> None:
    """What the mixed-cluster planner does not take, refused in one line each."""
    layout = [f for f, d in LAYOUT_ONLY if given(args, d)]
    if layout:
        raise ValueError(f"{', '.join(layout)}: on a mixed cluster the planner is DAPPLE's, type-aware (T=1, stages "
                         f"and layers per pool); drop {'it' if len(layout) == 1 else 'them'}, or give --search layout "
                         f"(the whole-layout search, type-aware)")
    if args.policies != DEFAULT_POLICIES:
        raise ValueError("--policies: on a mixed cluster stages are placed by pool (type-aware) or in device order "
                         "(type-blind); drop --policies")
    if args.no_simulate:
        raise ValueError("--no-simulate: a mixed cluster's plans are chosen and compared by simulation; drop it")
    if args.emit is not None:
        raise ValueError("--emit writes a whole-layout plan's job; a mixed cluster's plan runs in pipetwin only")
    if args.schedules not in (None, "dapple"):
        raise ValueError(f"--schedules {args.schedules}: on a mixed cluster the planner plans DAPPLE's 1F1B (the "
                         f"other schedules on a mixed cluster: pipetwin compare -c CLUSTER)")
    if args.recompute is not None and len(auto_values(args.recompute) or ()) > 1:
        raise ValueError("--recompute: the mixed-cluster planner plans one recomputation; give one")


def main_mixed(args, cluster, limit: float | None, model_name: str | None, sequences) -> int:
    """``sequences``: the command's reading of the global batch (-G, or --global-tokens), called once
    the options are checked."""
    from planner import SearchSpace
    from planner.hetero import plan_mixed
    check_mixed_args(args)
    have = min(p.device.memory_bytes or float("inf") for p in cluster.pools)
    if limit is not None and limit > have and not args.force:
        raise ValueError(f"--memory-limit {fmt_bytes(limit)} is above the smallest pool device's {fmt_bytes(have)} "
                         f"of memory: a plan within it would not fit (lower it, or pass --force)")
    recompute = (auto_values(args.recompute) or ("none",))[0] if args.recompute is not None else "none"
    args.global_batch = sequences()
    space = SearchSpace(max_stages=args.max_stages, devices=args.gpus)
    res = plan_mixed(args.model, cluster, args.global_batch, memory_limit=limit, recompute=recompute, space=space,
                     top_k=args.top, model_name=model_name, cost_model=args.cost_model,
                     profile_batch=args.profile_batch)
    kept, other = (res.blind, res.aware) if args.type_blind else (res.aware, res.blind)
    if args.out:
        from planner import save_plan
        ev = kept.evaluated
        save_plan(args.out, ev.plan, kept.work, cluster, limit, ev.estimate, ev.sim)
    if args.json:
        print_json({"cluster": cluster.name, "global_batch": res.global_batch,
                    "type_aware": res.aware.evaluated.to_dict(), "type_blind": res.blind.evaluated.to_dict(),
                    "type_blind_believed": res.believed.to_dict(), "gain": res.gain, "kept": "type-blind" if
                    args.type_blind else "type-aware", "configurations": res.configurations,
                    "seconds": res.seconds})
        return 0
    pools = " + ".join(f"{p.num_devices} x {p.device.name}" for p in cluster.pools)
    print(f"DAPPLE plan for {model_name} on {cluster.name} ({pools}), global batch {res.global_batch}, "
          f"type-{'blind' if args.type_blind else 'aware'}")
    for c in (kept, other):
        plan, est = c.evaluated.plan, c.evaluated.estimate
        name = "type-aware" if c is res.aware else "type-blind"
        print(f"  {name}: {plan.describe()}")
        unit, div = byte_unit([se.memory for se in est.stages])
        rows = []
        for s, (st, se) in enumerate(zip(plan.stages, est.stages)):
            pools_of = sorted({cluster.pool_of_device(d) for d in st.devices})
            rows.append({"stage": s, "layers": f"{st.start}-{st.stop - 1}", "replicas": st.replicas,
                         "pool": "+".join(cluster.pools[p].name for p in pools_of),
                         "devices": f"{st.devices[0]}-{st.devices[-1]}", "fwd_ms": se.f * 1e3, "bwd_ms": se.b * 1e3,
                         "allreduce_ms": se.allreduce * 1e3, f"memory_{unit}": se.memory / div})
        print(fmt_table(rows, list(rows[0]), {"fwd_ms": "{:.2f}", "bwd_ms": "{:.2f}", "allreduce_ms": "{:.2f}",
                                              f"memory_{unit}": "{:.3g}"}))
        sm = c.evaluated.sim
        print(f"  simulated: iteration {sm.iteration_time:.4g} s ({plan.global_batch / sm.iteration_time:.1f} "
              f"samples/s), bubble {sm.bubble_ratio:.3f}, peak memory {fmt_bytes(sm.peak_memory)}"
              + ("" if c.fits else " (over a pool's memory)"))
    b = res.believed
    print(f"  the type-blind planner believed {b.time:.4g} s/step (as if every GPU were the "
          f"{cluster.pools[0].device.name})")
    print(res.summary())
    print(f"search: {res.seconds:.2f} s, {res.configurations} (micro-batch count, stages, replicas) configurations")
    if args.out:
        print(f"wrote plan file: {printable(args.out)}")
    return 0
