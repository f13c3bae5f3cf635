"""Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
predicted from its configurations: held out.

Four GPT models (22B, 175B, 530B, 1T) at tensor parallel 8, no data parallelism, on DGX A100
80 GB nodes (``dgx-a100-ib``), built as :class:`cost_models.Job` s the way
:mod:`experiments.reproduce.megatron` builds Table 1's rows. Three comparisons:

* memory per GPU (Fig. 1): the first stage's peak activations (the memory ledger's walk of the
  schedule) with neither sequence parallelism nor recomputation, and with SP + selective
  recomputation; the weights, gradients and optimizer state of a middle stage (18 bytes/param);
* one 22B layer (Table 4): forward and backward (input + weight gradient, with the re-run
  forward under recomputation) of one block at micro-batch 4 in the ``a100`` kernel model, the
  tensor-parallel collectives on NVSwitch added;
* iteration time (Table 5): the simulated iteration with full recomputation, and with SP +
  selective recomputation.

Nothing is fitted on these numbers: the ``a100`` preset's two fitted constants come from Zero
Bubble Table 9 alone (:mod:`cost_models.stage_time_fit`), as the report says above its table.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from cost_models import load_cluster
from cost_models.bind import bind
from cost_models.files import write_output
from cost_models.memory import memory_report
from cost_models.parallel import Parallel
from cost_models.stage_time_fit import fit_note
from cost_models.transformer import TensorParallelGroup, TransformerCostModel
from sim import simulate_job

from ..progress import phase
from ..tables import markdown
from .megatron import CLUSTER, error, gpt, megatron_job, percent, save, table

GiB = 2 ** 30
QUICK_MODELS = ("22B", "175B")
COLUMNS = ["quantity", "model", "setting", "unit", "predicted", "measured", "error"]
MODES = {"full recompute": ("full", False), "sp + selective": ("selective", True)}
LAYER_EXPERIMENTS = {       # Table 4's rows: (recompute, sequence parallel)
    "baseline no recompute": ("none", False),
    "sequence parallel": ("none", True),
    "full recompute": ("full", False),
    "selective recompute": ("selective", False),
    "selective recompute + sequence parallel": ("selective", True),
}


def _spec(r):
    return gpt(f"gpt-{r.model}", int(r.layers), int(r.hidden), int(r.heads), int(r.micro_batch))


def _job(r, recompute: str, sp: bool):
    return megatron_job(_spec(r), tp=int(r.tp), pp=int(r.pp), dp=1,
                        microbatches=int(r.global_batch) // int(r.micro_batch), chunks=int(r.interleave),
                        recompute=recompute, sequence_parallel=sp)


def _row(quantity, model, setting, unit, predicted, measured) -> dict:
    return {"quantity": quantity, "model": model, "setting": setting, "unit": unit, "predicted": predicted,
            "measured": measured, "error": error(predicted, measured)}


def memory_rows(r) -> list[dict]:
    out = []
    for setting, (rc, sp), col in (("tp only", ("none", False), "mem_act_tp_baseline_gib"),
                                   ("sp + selective", ("selective", True), "mem_act_sp_selective_gib")):
        b = bind(_job(r, rc, sp))
        mem = memory_report(b.lowered, b.costs)
        out.append(_row("activation memory", r.model, setting, "GiB", mem.activation[0] / GiB, float(r[col])))
        if setting == "tp only":
            middle = int(r.pp) // 2
            out.append(_row("params + optimizer", r.model, "middle stage", "GiB", mem.static[middle] / GiB,
                            float(r.mem_params_optimizer_gib)))
    return out


def layer_rows(r) -> list[dict]:
    """Table 4: one block (layer index 1 of the embedding, blocks, head ledger) of the 22B model."""
    cluster = load_cluster(f"{CLUSTER}:1")
    group = TensorParallelGroup(cluster, int(r.tp))
    out = []
    for _, x in table("korthikanti-2022-layer-22b.csv").iterrows():
        rc, sp = LAYER_EXPERIMENTS[x.experiment]
        lc = TransformerCostModel(_spec(r), cluster.device, compute="kernels", tp_group=group,
                                  parallel=Parallel(tp=int(r.tp), recompute=rc, sequence_parallel=sp)).layer_costs()
        fwd, bwd = lc.f[1] * 1e3, (lc.b_input[1] + lc.w[1]) * 1e3
        out.append(_row("layer forward", r.model, x.experiment, "ms", fwd, float(x.forward_ms)))
        out.append(_row("layer backward", r.model, x.experiment, "ms", bwd, float(x.backward_ms)))
    return out


def iteration_rows(r) -> list[dict]:
    out = []
    for setting, (rc, sp) in MODES.items():
        _, res = simulate_job(_job(r, rc, sp))
        col = "iter_s_full_recompute" if rc == "full" else "iter_s_sp_selective"
        out.append(_row("iteration time", r.model, setting, "s", res.iteration_time, float(r[col])))
    return out


def predictions(quick: bool) -> pd.DataFrame:
    models = table("korthikanti-2022.csv")
    if quick:
        models = models[models.model.isin(QUICK_MODELS)]
    rows = []
    for _, r in models.iterrows():
        phase(f"korthikanti: {r.model}")
        rows += memory_rows(r)
        if r.model == "22B":
            rows += layer_rows(r)
        rows += iteration_rows(r)
    return pd.DataFrame(rows, columns=COLUMNS)


def plot(df: pd.DataFrame, path: Path) -> None:
    from ..plots import plt, save_figure
    parts = list(dict.fromkeys(df.quantity))
    fig, axes = plt.subplots(1, len(parts), figsize=(3.6 * len(parts), 3.6), squeeze=False)
    for ax, q in zip(axes[0], parts):
        sub = df[df.quantity == q]
        ax.scatter(sub.measured, sub.predicted)
        hi = max(sub.measured.max(), sub.predicted.max()) * 1.05
        ax.plot([0, hi], [0, hi], "k:", lw=1)
        ax.set_title(f"{q} ({sub.unit.iloc[0]})", fontsize=9)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
    save_figure(fig, path)


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per quantity and setting (the layer's rows left out), one column per model:
    "predicted / measured (error)"."""
    rest = df[~df.quantity.str.startswith("layer")]
    cells = {}
    for _, x in rest.iterrows():
        key = f"{x.quantity}, {x.setting} ({x.unit})"
        cells.setdefault(key, {})[x.model] = f"{x.predicted:.4g} / {x.measured:.4g} ({percent(x.error)})"
    return pd.DataFrame.from_dict(cells, orient="index").rename_axis("predicted / measured").reset_index()


def layer_line(df: pd.DataFrame) -> str:
    parts = []
    for q in ("layer forward", "layer backward"):
        e = df[df.quantity == q].error
        if len(e):
            parts.append(f"{q.split()[1]} {percent(e.min())} to {percent(e.max())}")
    return f"22B layer (Table 4, {len(df[df.quantity == 'layer forward'])} settings): " + ", ".join(parts) + "."


def run(out_dir, quick: bool = False) -> str:
    df = predictions(quick)
    out = save(out_dir, "korthikanti", df, plot)
    shown = df.assign(error=df.error.map(percent))
    shown.insert(0, "row", "held out")
    lines = ["# Korthikanti et al. 2022, predicted (held out: nothing fitted on it)", "",
             f"TP 8, no data parallelism, {CLUSTER}:NODES, the `a100` preset's kernel model (figure: "
             "korthikanti.png).", "", fit_note(), "", markdown(shown, floatfmt=".4g"), "", "## Summary", "",
             markdown(summary_table(df)), "", layer_line(df)]
    report = "\n".join(lines)
    write_output(out / "report.md", report + "\n", "report")
    return report
