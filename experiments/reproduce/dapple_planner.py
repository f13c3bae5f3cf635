"""Reproduce the DAPPLE planner's evaluation (Fan et al., PPoPP 2021) on DAPPLE's own profiles.

DAPPLE's released V100 profiles (``cost_models/presets/profiles/dapple-v100``: VGG-19, GNMT-16,
BERT-48, XLNet-36, AmoebaNet-36 in PipeDream's graph format, :mod:`cost_models.workloads.pipedream_workload`)
are planned on the paper's two kinds of 16-GPU cluster: config A, two servers of 8 V100 with NVLink and one
25 Gb/s Ethernet NIC each (``v100-2x8-25gbe``: DAPPLE's hierarchical device set ``[8, 16]``), and
config B, sixteen single-V100 servers on 25 Gb/s Ethernet (``v100-16x1-25gbe``: its flat set), at
the paper's global batch of 128 (its data-parallel comparisons are at GBS 128 for every model).
Activations: the profiles list only each node's output, so, as DAPPLE's planner does for these
models, BERT, XLNet and AmoebaNet keep DAPPLE's whole-model activation bytes per sample
(:data:`DAPPLE_ACTIVATION_PER_SAMPLE`, the ``peak_activation_per_batch`` its planner tests set).

Each model is planned twice: with the profile scaled linearly to every micro-batch (``linear``,
what DAPPLE's planner did) and with the kernel cost model's micro-batch curve (``kernels``: a
sample costs more on a small micro-batch, so the micro-batch count is a real choice). For each,
the simulated iteration time of the DAPPLE plan, of the PipeDream planner's plan (``M = P``: the
per-GPU batch of data parallelism, PipeDream's own setting; ``best M``: the micro-batch count that
suits its plan best) and of data parallelism on all 16 GPUs, the speed-ups, and beside them the
paper's: at most 3.23x over PipeDream's planner (abstract) and, over the best data-parallel
baseline, 1.71x on average on config A and 1.37x on config B (up to 2.32x, GNMT-16 on the paper's
config C, which is not modelled here; these averages are a sentence of the paper's LaTeX source,
commented out of its abstract, with the note that they are at GBS 128). Per-model numbers of the
paper are not transcribed (not found in the sources at hand), so each row is compared with those
aggregates. ``term`` says which part of the analytical iteration time (warm-up, steady phase,
ending = drain + the all-reduce sticking out) makes most of the difference between the baseline's
plan and DAPPLE's.

A second table: weak scaling on 25 Gb/s Ethernet, 2 to 32 V100 (servers of 8), DAPPLE plan vs
data parallelism, with the profiles scaled linearly.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import pandas as pd

from cost_models.files import write_output
from cost_models.workloads.pipedream_workload import profile_workload
from planner import Topology, plan_training
from planner.choose import data_parallel_plan, pipedream_plan, with_simulation
from planner.clusters import gpus_on_servers, resolve_cluster

from ..common import write_csv
from ..progress import phase
from ..tables import markdown

PAPER_MAX_SPEEDUP_OVER_PIPEDREAM = 3.23
PAPER_DP_MEAN = {"A": 1.71, "B": 1.37, "C": 1.79}     # over the best data-parallel baseline, GBS 128
PAPER_DP_MAX = ("gnmt-16", "C", 2.32)
GLOBAL_BATCH = 128
PROFILES = {"vgg-19": "vgg-19-pbs-32.txt", "gnmt-16": "gnmt-16-pbs-64.txt", "bert-48": "bert-48-pbs-2.txt",
            "xlnet-36": "xlnet-36-pbs-1.txt", "amoebanet-36": "amoeba-36-pbs-1.txt"}
# bytes per sample the whole model keeps for the backward, as DAPPLE's planner tests set them
DAPPLE_ACTIVATION_PER_SAMPLE = {"bert-48": 1733171968.0, "xlnet-36": 3942774528.0, "amoebanet-36": 250845152.0}
CLUSTERS = {"A": "v100-2x8-25gbe", "B": "v100-16x1-25gbe"}
COST_MODELS = ("linear", "kernels")
QUICK_MODELS = ("bert-48", "vgg-19")
SCALING = {"bert-48": 8, "vgg-19": 32}             # samples per GPU
SCALING_GPUS = [2, 4, 8, 16, 32]


def profile_path(model: str) -> str:
    return str(resources.files("cost_models") / "presets" / "profiles" / "dapple-v100" / PROFILES[model])


def workload(model: str, device, cost_model: str):
    return profile_workload(profile_path(model), device, cost_model=cost_model,
                            activation_per_sample=DAPPLE_ACTIVATION_PER_SAMPLE.get(model))


def _parts(est) -> dict:
    """warm-up, steady, drain (the last backward back to the pivot) and all-reduce (the part of the
    gradient all-reduce and optimizer step that sticks out after the compute) of an estimate."""
    tail, bp = float("-inf"), 0.0
    for s, st in enumerate(est.stages):
        tail = max(tail, st.allreduce + st.optim - bp)
        bp += st.b + (est.links[s][1] if s < len(est.links) else 0.0)
    return {"warm-up": est.warmup, "steady": est.steady, "drain": est.ending - tail, "all-reduce": tail}


def term(base, best) -> str:
    """Which term of the analytical latency makes most of (baseline - DAPPLE), with every term's share."""
    if base is None:
        return "-"
    b, d = _parts(base.estimate), _parts(best.estimate)
    diff = {k: b[k] - d[k] for k in b}
    k = max(diff, key=lambda x: diff[x])
    rest = ", ".join(f"{n} {v:+.3g}" for n, v in diff.items() if n != k)
    return f"**{k} {diff[k]:+.3g} s** ({rest})"


def compare(model: str, config: str, cost_model: str, G: int = GLOBAL_BATCH) -> dict:
    cl = resolve_cluster(CLUSTERS[config])
    work = workload(model, cl.device, cost_model)
    res = plan_training(work, cl, G, top_k=4, model_name=model)
    best = res.best
    _PLANS[(model, config, cost_model)] = best.plan
    P = cl.num_devices
    row = {"model": model, "config": config, "cluster": cl.name, "cost_model": cost_model, "global_batch": G,
           "dapple_plan": best.plan.describe(), "dapple_M": best.plan.microbatches, "dapple_s": best.time,
           "dapple_est_s": best.estimate.latency, "search_s": res.search.seconds}
    fixed = pipedream_plan(work, Topology(cl), G, microbatches=P if G % P == 0 else None, model=model)
    fixed = fixed and with_simulation(fixed, work, cl, None)
    baselines = (("pipedream_m_p", fixed), ("pipedream_best_m", res.pipedream), ("data_parallel", res.data_parallel))
    for key, ev in baselines:
        row[f"{key}_plan"] = ev.plan.describe() if ev is not None else res.baseline_notes.get(key, "does not fit")
        row[f"{key}_s"] = ev.time if ev is not None else float("nan")
        row[f"speedup_over_{key}"] = ev.time / best.time if ev is not None else float("nan")
        row[f"{key}_term"] = term(ev, best)
    dp = res.data_parallel
    row["data_parallel_allreduce_s"] = dp.estimate.stages[0].allreduce if dp is not None else float("nan")
    row["data_parallel_compute_s"] = (dp.estimate.warmup + dp.estimate.steady) if dp is not None else float("nan")
    row["paper_max_over_pipedream"] = PAPER_MAX_SPEEDUP_OVER_PIPEDREAM
    row["paper_dp_mean"] = PAPER_DP_MEAN[config]
    return row


_PLANS: dict = {}
_PROBE: dict = {}


def network_probe(model: str, config: str, cost_model: str, factors=(1, 2, 100)) -> pd.DataFrame:
    """The DAPPLE plan of one row re-estimated and re-simulated with the inter-server network (and
    the links inside a server) ``factor`` x faster: how much of the analytical/simulated gap is the network."""
    import dataclasses

    from planner import evaluate_plan
    plan = _PLANS[(model, config, cost_model)]
    base = resolve_cluster(CLUSTERS[config])
    rows = []
    for k in factors:
        cl = dataclasses.replace(base, inter=dataclasses.replace(base.inter, bandwidth=base.inter.bandwidth * k),
                                 intra=dataclasses.replace(base.intra, bandwidth=base.intra.bandwidth * k))
        ev = evaluate_plan(plan, workload(model, cl.device, cost_model), cl)
        rows.append({"network_x": k, "analytical_s": ev.estimate.latency, "round_trip_s": ev.estimate.latency_rt,
                     "simulated_s": ev.sim.iteration_time, "gap": ev.sim.iteration_time / ev.estimate.latency - 1})
    return pd.DataFrame(rows)


def planner_table(quick: bool) -> pd.DataFrame:
    rows = []
    models = QUICK_MODELS if quick else tuple(PROFILES)
    configs = ("A",) if quick else tuple(CLUSTERS)
    for cfg in configs:
        for m in models:
            for cm in COST_MODELS:
                rows.append(compare(m, cfg, cm))
    return pd.DataFrame(rows)


def scaling_table(quick: bool) -> pd.DataFrame:
    base = resolve_cluster("v100-4x8-25gbe")
    rows = []
    models = dict(list(SCALING.items())[1:]) if quick else SCALING
    gpus = [2, 8, 16] if quick else SCALING_GPUS
    for m, per in models.items():
        for n in gpus:
            cl = gpus_on_servers(base, n)
            G = per * n
            work = workload(m, cl.device, "linear")
            res = plan_training(work, cl, G, top_k=3, baselines=False, model_name=m)
            dp = with_simulation(data_parallel_plan(work, Topology(cl), G, model=m), work, cl, None)
            rows.append({"model": m, "gpus": n, "servers": cl.nodes, "global_batch": G,
                         "dapple_samples_per_s": G / res.best.time, "dp_samples_per_s": G / dp.time,
                         "speedup": dp.time / res.best.time, "dapple_plan": res.best.plan.describe()})
    return pd.DataFrame(rows)


def plot(table: pd.DataFrame, scaling: pd.DataFrame, out: Path) -> None:
    from ..plots import plt, save_figure
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1.6, 1]})
    ax = axes[0]
    labels = [f"{r.model} {r.config} {r.cost_model}" for r in table.itertuples()]
    x = range(len(table))
    w = 0.27
    for k, (col, name) in enumerate((("speedup_over_pipedream_m_p", "over PipeDream (M = P)"),
                                     ("speedup_over_pipedream_best_m", "over PipeDream (best M)"),
                                     ("speedup_over_data_parallel", "over data parallel"))):
        ax.bar([i + (k - 1) * w for i in x], table[col], w, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(PAPER_MAX_SPEEDUP_OVER_PIPEDREAM, color="r", ls="--", lw=0.8, label="paper: up to 3.23x over PipeDream")
    for cfg, v in PAPER_DP_MEAN.items():
        if cfg in set(table.config):
            ax.axhline(v, color="g", ls=":", lw=0.8)
    ax.plot([], [], color="g", ls=":", label="paper: mean over DP (A 1.71x, B 1.37x)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7, rotation=40, ha="right")
    ax.set_ylabel("speed-up of the DAPPLE plan (simulated)")
    ax.legend(fontsize=7)
    ax = axes[1]
    for m, g in scaling.groupby("model", sort=False):
        ax.plot(g.gpus, g.dapple_samples_per_s, marker="o", label=f"{m}: DAPPLE plan")
        ax.plot(g.gpus, g.dp_samples_per_s, marker="x", ls="--", label=f"{m}: data parallel")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("V100 GPUs (8 per server, 25 Gb/s Ethernet)")
    ax.set_ylabel("samples / s (simulated)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save_figure(fig, out)


def _findings(t: pd.DataFrame) -> list[str]:
    out = []
    for cm in COST_MODELS:
        g = t[t.cost_model == cm]
        if g.empty:
            continue
        pd_max = g.speedup_over_pipedream_m_p.max()
        top = g.loc[g.speedup_over_pipedream_m_p.idxmax()]
        dp = {c: g[g.config == c].speedup_over_data_parallel.mean() for c in sorted(set(g.config))}
        dp_txt = ", ".join(f"config {c}: {v:.2f}x (paper {PAPER_DP_MEAN[c]:.2f}x)" for c, v in dp.items())
        out.append(f"- **{cm}**: up to {pd_max:.2f}x over PipeDream's plan at M = P ({top.model}, config "
                   f"{top.config}; paper: up to {PAPER_MAX_SPEEDUP_OVER_PIPEDREAM}x), "
                   f"{g.speedup_over_pipedream_best_m.max():.2f}x over its best-M reading; mean over data "
                   f"parallelism {dp_txt}.")
    return out


def _dominant(col: pd.Series) -> str:
    names = col.str.extract(r"\*\*([a-z-]+) ")[0].value_counts()
    return ", ".join(f"{k} in {v}" for k, v in names.items())


def _differences(t: pd.DataFrame) -> list[str]:
    """Where and why our numbers differ from the paper's, from the table itself."""
    out = []
    n = len(t)
    above = t[t.speedup_over_data_parallel > t.paper_dp_mean]
    hi = above.assign(share=above.data_parallel_allreduce_s / above.data_parallel_s)
    detail = "; ".join(f"{r.model} {r.config} {r.cost_model}: all-reduce {r.data_parallel_allreduce_s:.2f} s of "
                       f"{r.data_parallel_s:.2f} s" for r in hi.itertuples())
    out.append(f"- **Over data parallelism** ours is above the paper's mean in {len(above)} of {n} rows "
               f"({', '.join(sorted(set(above.model))) or 'none'}). The term that makes data parallelism slower is "
               f"the same in every row: {_dominant(t.data_parallel_term)} of {n}. Our data-parallel baseline "
               "all-reduces the whole model's fp32 gradients once, after the last backward, over 25 Gb/s Ethernet "
               f"between servers, and at GBS 128 its compute is short next to that ({detail}). The paper's "
               f"averages ({PAPER_DP_MEAN['A']}x, {PAPER_DP_MEAN['B']}x) imply a data-parallel baseline whose "
               "all-reduce costs far less than ours: overlapped with the backward, or on a faster network than "
               "our reading of its configs; the sources at hand do not say which.")
    out.append(f"- **Over PipeDream's planner** ours reaches {t.speedup_over_pipedream_m_p.max():.2f}x at M = P "
               f"against the paper's 3.23x. Which term makes the difference per row: "
               f"{_dominant(t.pipedream_m_p_term)} rows (M = P). Our baseline is PipeDream's objective (slowest "
               "element) searched by the same exact search over the same plan space and simulated on the same "
               "engine, and it breaks PipeDream's many ties (a layer that cannot be split is the slowest element) "
               "with DAPPLE's latency: the strongest plan PipeDream's objective allows, where the paper ran the "
               "plan PipeDream's own planner printed.")
    slow = t[t.speedup_over_pipedream_best_m < 1 - 1e-9]
    err = (t.dapple_est_s / t.dapple_s - 1).abs()
    worst = t.loc[err.idxmax()]
    probe = network_probe(worst.model, worst.config, worst.cost_model)
    gaps = ", ".join(f"{r.gap:.0%} at {r.network_x:g}x" for r in probe.itertuples())
    rows = "; ".join(f"{r.model} {r.config} {r.cost_model}: {r.speedup_over_pipedream_best_m:.2f}x"
                     for r in slow.itertuples()) or "none"
    out.append(f"- **Analytical vs simulated.** DAPPLE's objective picks the candidates that are simulated, and its "
               f"analytical latency is off from the simulated one by up to {err.max():.0%} (median "
               f"{err.median():.0%}); where it misjudges, DAPPLE's plan can come out slower than PipeDream's best-M "
               f"plan in simulation ({rows}). For the worst row ({worst.model}, config {worst.config}, "
               f"{worst.cost_model}) the simulated time exceeds the analytical one by {gaps} network speed: "
               + ("the term is mostly the network. " if probe.gap.iloc[-1] < probe.gap.iloc[0] / 2 else
                  "the network is only part of it. ")
               + "The pivot formulation prices each stage boundary as a full-duplex link of its own that overlaps "
               "with compute; in the simulation a GPU's port (and a server's NIC) carries its outgoing activations "
               "and its outgoing gradients together, and 1F1B's round trips wait on them.")
    _PROBE[0] = probe
    k = t[t.cost_model == "kernels"].set_index(["model", "config"]).dapple_M
    lin = t[t.cost_model == "linear"].set_index(["model", "config"]).dapple_M
    both = k.index.intersection(lin.index)
    fewer = sum(1 for i in both if k[i] < lin[i])
    out.append(f"- **kernels vs linear**: with the micro-batch curve DAPPLE's plan takes fewer micro-batches in "
               f"{fewer} of {len(both)} cases (larger micro-batches, cheaper per sample), and PipeDream's M = P "
               "reading, which keeps the per-GPU batch of data parallelism small, loses more "
               f"(max {t[t.cost_model == 'kernels'].speedup_over_pipedream_m_p.max():.2f}x vs "
               f"{t[t.cost_model == 'linear'].speedup_over_pipedream_m_p.max():.2f}x).")
    out.append("- Memory: the cluster presets have 32 GB V100s; BERT, XLNet and AmoebaNet keep DAPPLE's activation "
               "bytes per sample, VGG-19 and GNMT-16 the profiles' own output sizes.")
    return out


def run(out_dir, quick: bool = False) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    phase("dapple-planner: DAPPLE vs PipeDream vs data parallel")
    t = planner_table(quick)
    write_csv(t, out / "planner_comparison.csv")
    phase("dapple-planner: scaling on 25 GbE")
    sc = scaling_table(quick)
    write_csv(sc, out / "scaling_25gbe.csv")
    plot(t, sc, out / "dapple_planner.png")
    short = t[["model", "config", "cost_model", "dapple_M", "dapple_s", "dapple_est_s", "pipedream_m_p_s",
               "pipedream_best_m_s",
               "data_parallel_s", "speedup_over_pipedream_m_p", "speedup_over_pipedream_best_m",
               "paper_max_over_pipedream", "speedup_over_data_parallel", "paper_dp_mean"]]
    terms = t[["model", "config", "cost_model", "pipedream_m_p_term", "pipedream_best_m_term", "data_parallel_term"]]
    plans = t[["model", "config", "cost_model", "dapple_plan", "pipedream_m_p_plan", "pipedream_best_m_plan",
               "data_parallel_plan"]]
    parts = ["# DAPPLE planner on DAPPLE's own profiles (simulated)", "",
             f"Global batch {GLOBAL_BATCH}; config A = {CLUSTERS['A']}, config B = {CLUSTERS['B']}. Iteration times "
             "are simulated (SimPy engine, seconds); a speed-up is the baseline's time / the DAPPLE plan's. "
             "`linear`: the profiles scaled linearly to every micro-batch, as DAPPLE's planner did; `kernels`: "
             "scaled by the kernel cost model's micro-batch curve. The paper reports up to "
             f"{PAPER_MAX_SPEEDUP_OVER_PIPEDREAM}x over PipeDream's planner and, over the best data-parallel "
             f"baseline at GBS 128, {PAPER_DP_MEAN['A']}x (config A) and {PAPER_DP_MEAN['B']}x (config B) on "
             f"average (up to {PAPER_DP_MAX[2]}x, {PAPER_DP_MAX[0]} on config {PAPER_DP_MAX[1]}); its per-model "
             "numbers are not transcribed, so each row sits beside those aggregates.", "",
             "## Findings", "", *_findings(t), "",
             "## Speed-ups (figure: dapple_planner.png, left)", "", markdown(short), "",
             "## Which term makes the difference (analytical: baseline's plan - DAPPLE's plan)", "",
             markdown(terms), "",
             "## Plans", "", markdown(plans), "",
             "## Where we differ from the paper", "", *_differences(t), "",
             "Network probe of the worst row (the DAPPLE plan with every link k x faster):", "",
             markdown(_PROBE[0]), "",
             "## Weak scaling on 25 Gb/s Ethernet (linear profiles; figure: dapple_planner.png, right)", "",
             markdown(sc), "",
             "2-8 GPUs sit in one server (NVLink); 16 and 32 span 2 and 4 servers with one 25 Gb/s NIC each, "
             "where data parallelism's gradient all-reduce crosses Ethernet."]
    report = "\n".join(parts)
    write_output(out / "report.md", report + "\n", "report")
    return report
