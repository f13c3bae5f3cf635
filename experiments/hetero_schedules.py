"""``pipetwin reproduce hetero-schedules``: 1F1B (dapple), ZB-H1, ZB-V, zb-auto and BitPipe when
stage times differ, on a mixed A100 + H100 cluster (issue 45, item 4).

Two settings, every number simulated at run time:

1. **Stage costs** (``--stage-costs``, no bandwidth, a fixed message time): D = 4 stages, the first
   two on the slow pool, k times the last two, k the A100 / H100 ratio of one stage's forward that
   the kernel model gives on the ``a100-h100`` cluster for the model (:func:`pool_ratio`); F = 1,
   b = w = 1 (B = 2 unsplit) on the fast stages, no message time. 1F1B's closed form with
   non-uniform stages is :func:`dapple_closed_form`; every schedule is at least the slowest
   device's work, ``N max_d (F + B + W)_d``.
2. **The cluster** (``--cluster a100-h100``: 2 A100 nodes + 2 H100 nodes, T = 8, D = 4, stages 0-1
   on A100, 2-3 on H100), the model's uniform layer split: step time, bubble and busy share per pool.

zb-auto orders its ops from these per-stage costs (``schedules/zb_auto.py``), so the fast stages'
idle time takes the slow stages' W's where the dependencies allow; the others keep their
uniform-cost orders. zb-auto minimises the Zero Bubble paper's cost, the longest device span from
its first op (the staggered start is free), not the step time: with the slow pool first, ZB-H1's
order is already its best on the stage costs, and on the cluster it picks an order 0.5 ms shorter
in span and 2.5 ms longer in step (0.743 s against ZB-H1's 0.742 s at N = 8).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from cost_models import Job, Layout
from cost_models.bind import bind
from cost_models.files import write_output
from cost_models.parallel import Parallel
from sim import simulate_job

from .common import metrics_record, write_csv
from .tables import markdown

SCHEDULES = ("dapple", "zb-h1", "zb-v", "zb-auto", "bitpipe")
CLUSTER = "a100-h100"
MODEL = "llama3-8b"
TP, D = 8, 4
MESSAGE = 0.0           # stage-cost setting: no message time (the cluster setting has its links)


def pool_ratio(model: str = MODEL, cluster: str = CLUSTER) -> float:
    """The slow pool's forward time over the fast pool's for the same stage (stage 1, no head or
    embedding) under the kernel model on ``cluster`` (rank 0 on the first pool, rank D - 1 on the
    second)."""
    job = Job(layout=Layout(schedule="dapple", devices=D, microbatches=D), model=model, cluster=cluster,
              parallel=Parallel(tp=TP))
    c = bind(job).costs
    a, b = c.for_rank(0), c.for_rank(D - 1)
    return a.f[0][1] / b.f[0][1]


def stage_costs_text(k: float, message: float = MESSAGE) -> str:
    """A ``--stage-costs`` file: stages 0 .. D/2-1 k times stages D/2 .. D-1 (F = b = w = 1)."""
    rows = [f"  - {{f: {s!r}, b: {s!r}, w: {s!r}}}" for s in [k] * (D // 2) + [1.0] * (D // 2)]
    return "stages:\n" + "\n".join(rows) + f"\nmessage: {message:g}\n"


def dapple_closed_form(f: list[float], b: list[float], N: int, message: float) -> float:
    """1F1B's step time with per-stage forward ``f``, full backward ``b`` and a posted ``message``,
    s the last stage of the largest F + B: micro-batch 0's forwards down to s, then s busy with its
    N F's and B's but for one wait, for micro-batch 0's gradient to come back from below after its
    D - s warm-up forwards (the wait is ``sum_{d>s} (F + B)_d + 2 (D-1-s) m - (D-1-s) F_s`` when
    positive), then the last micro-batch's backwards up to stage 0:
    ``T = sum_{d<s} (F_d + B_d + 2 m) + N (F + B)_s + max(0, wait)``.
    Exact where s's neighbours keep up (tests/test_hetero_schedules.py: one slow stage anywhere, or a
    slow pool without message time); where they do not, the classic
    ``sum_d (F + B)_d + (N - 1) max_d (F + B)_d`` is only an upper bound."""
    D = len(f)
    fb = [x + y for x, y in zip(f, b)]
    s = max(d for d in range(D) if fb[d] == max(fb))
    wait = sum(fb[s + 1:]) + 2 * (D - 1 - s) * message - (D - 1 - s) * f[s]
    return sum(fb[:s]) + 2 * s * message + N * fb[s] + max(0.0, wait)


def _row(job: Job, setting: str, pools: list[tuple[str, list[int]]] | None = None) -> dict:
    bound, res = simulate_job(job)
    rec = metrics_record(res, **bound.report)
    m = res.metrics()
    row = {"setting": setting, "schedule": job.layout.schedule, "N": job.layout.microbatches,
           "step_time": m.iteration_time, "bubble": m.bubble_ratio}
    if rec.get("pools"):
        for p in rec["pools"]:
            row[f"busy_{p['name']}"] = p["busy"]
    else:
        busy = {p.device: p.busy for p in m.per_device}
        for name, ranks in pools or []:
            row[f"busy_{name}"] = sum(busy[r] for r in ranks) / len(ranks) / m.iteration_time
    return row


def stage_table(k: float, Ns, path: Path) -> pd.DataFrame:
    """Setting 1 at ratio ``k`` (the stage-costs file written to ``path``)."""
    write_output(path, stage_costs_text(k), "stage costs")
    pools = [("a100", list(range(D // 2))), ("h100", list(range(D // 2, D)))]
    rows = []
    for N in Ns:
        for s in SCHEDULES:
            job = Job(layout=Layout(schedule=s, devices=D, microbatches=N), stage_costs=str(path))
            rows.append(_row(job, f"stage costs, k = {k:.3g}", pools))
    return pd.DataFrame(rows)


def cluster_table(Ns, model: str = MODEL) -> pd.DataFrame:
    """Setting 2: the model on the mixed cluster."""
    rows = []
    for N in Ns:
        for s in SCHEDULES:
            job = Job(layout=Layout(schedule=s, devices=D, microbatches=N), model=model, cluster=CLUSTER,
                      parallel=Parallel(tp=TP))
            rows.append(_row(job, f"{model} on {CLUSTER}"))
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, path: Path) -> None:
    from .plots import plt, save_figure
    settings = list(dict.fromkeys(df.setting))
    fig, axes = plt.subplots(2, len(settings), figsize=(6 * len(settings), 7), squeeze=False)
    for col, setting in enumerate(settings):
        sub = df[df.setting == setting]
        Ns = sorted(sub.N.unique())
        width = 0.8 / len(SCHEDULES)
        ax = axes[0][col]
        for i, s in enumerate(SCHEDULES):
            vals = [float(sub[(sub.N == n) & (sub.schedule == s)].step_time.iloc[0]) for n in Ns]
            ax.bar([j + i * width for j in range(len(Ns))], vals, width, label=s)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(Ns))], [f"N = {n}" for n in Ns])
        ax.set_ylabel("step time (simulated)")
        ax.set_title(setting)
        ax.set_ylim(0, 1.3 * float(sub.step_time.max()))       # room for the legend above the bars
        ax.legend(fontsize=8, ncol=3, loc="upper left")
        ax = axes[1][col]
        last = sub[sub.N == Ns[-1]]
        for i, pool in enumerate(("a100", "h100")):
            ax.bar([j + i * 0.4 for j in range(len(SCHEDULES))],
                   [float(last[last.schedule == s][f"busy_{pool}"].iloc[0]) for s in SCHEDULES], 0.4, label=pool)
        ax.set_xticks([j + 0.2 for j in range(len(SCHEDULES))], list(SCHEDULES))
        ax.set_ylabel(f"busy share per pool, N = {Ns[-1]}")
        ax.set_ylim(0, 1.25)
        ax.legend(fontsize=8, ncol=2, loc="upper left")
    save_figure(fig, path)


def run(out_dir, quick: bool = False) -> str:
    out = Path(out_dir)
    Ns = [8] if quick else [8, 16, 32]
    k = pool_ratio()
    st = stage_table(k, Ns, out / "stages.yaml")
    cl = cluster_table(Ns)
    df = pd.concat([st, cl], ignore_index=True)
    write_csv(df, out / "hetero_schedules.csv")
    plot(df, out / "hetero_schedules.png")
    checks = []
    for N in Ns:
        f = [k] * (D // 2) + [1.0] * (D // 2)
        want = dapple_closed_form(f, [2 * x for x in f], N, MESSAGE)
        got = float(st[(st.N == N) & (st.schedule == "dapple")].step_time.iloc[0])
        checks.append(f"N = {N}: 1F1B simulated {got:.4g}, closed form {want:.4g}; slowest device's work "
                      f"N x 3k = {3 * N * k:.4g}")
    report = "\n".join([
        "# Schedules on a mixed A100 + H100 cluster (figure: hetero_schedules.png)", "",
        f"A100 / H100 forward time of one {MODEL} stage (T = {TP}, kernel model on {CLUSTER}): k = {k:.3f}.", "",
        *checks, "", markdown(df)])
    write_output(out / "report.md", report + "\n", "report")
    return report
