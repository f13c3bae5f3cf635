"""The kernel cost model against measured layer times: Chimera's V100 profiles, batch 1..64.

Chimera's released profiles (``cost_models/presets/measurements/chimera-v100``: one BERT, OPT or
T5 layer in fp32 on a V100, forward and backward time against the batch size) show what a linear
cost model misses: a sample costs several times less at batch 64 than at batch 1, and the
backward/forward ratio drifts. This target fits the kernel model's constants
(:mod:`cost_models.kernels`; :func:`cost_models.layer_measurements.fit_constants`) on the layers the
set names as ``fit`` and reports the error on every layer, the ``held_out`` ones being the test:

* ``errors.csv``: per layer and batch, measured and modelled F and B (ms), the relative errors;
* ``speedups.csv``: per layer, the per-sample speed-up from the smallest to the largest batch, measured
  and modelled (F, B, F + B);
* ``cross_family.csv`` (not with ``--quick``): the constants refitted on two of the three families
  and tested on the third, a harder hold-out than a size of the same family;
* ``cost_curves.png``: measured vs modelled time per sample against the batch, one panel per layer;
* ``report.md``.

The aims: median error <= 15 %, and the per-sample speed-up from batch 1 to 64 within 30 % of
measured: that speed-up is what decides the micro-batch size and count a plan takes, and the linear
model has none (1.0 by construction). The device preset (``v100.yaml``) carries the constants this
fit prints; the report says whether they agree.
"""
from __future__ import annotations

from pathlib import Path
from statistics import median

import pandas as pd

from cost_models.files import write_output
from cost_models.layer_measurements import error_table, fit_constants, load_measurements, speedups

from ..common import write_csv
from ..tables import markdown

AIM_MEDIAN, AIM_SPEEDUP = 0.15, 0.30


def summary(rows: list[dict]) -> pd.DataFrame:
    """Median and max |error| of F and B (and both) per layer and over the fit / held-out sets."""
    df = pd.DataFrame(rows)
    out = []
    for key, g in list(df.groupby("layer", sort=False)) + list(df.groupby("set", sort=False)):
        errs = list(g.f_error.abs()) + list(g.b_error.abs())
        out.append({"group": key, "set": g.set.iloc[0] if key not in ("fit", "held-out") else key,
                    "points": len(errs), "median_abs_error": median(errs), "max_abs_error": max(errs),
                    "f_median": g.f_error.abs().median(), "b_median": g.b_error.abs().median()})
    return pd.DataFrame(out)


def cross_family(ms) -> pd.DataFrame:
    fams = sorted({l.shape.arch for l in ms.layers})
    rows = []
    for test in fams:
        train = [l.name for l in ms.layers if l.shape.arch != test]
        c, rms = fit_constants(ms, train)
        errs = error_table(ms, c, layers=[l.name for l in ms.layers if l.shape.arch == test])
        e = [abs(r["f_error"]) for r in errs] + [abs(r["b_error"]) for r in errs]
        sp = [s for s in speedups(ms, c) if s["layer"] in {r["layer"] for r in errs}]
        rows.append({"test_family": test, "fitted_on": ",".join(train), "median_abs_error": median(e),
                     "max_abs_error": max(e), "max_speedup_error_fb": max(abs(s["fb_error"]) for s in sp)})
    return pd.DataFrame(rows)


def plot(ms, rows: list[dict], out: Path) -> None:
    from ..plots import plt, save_figure
    df = pd.DataFrame(rows)
    names = [l.name for l in ms.layers]
    fig, axes = plt.subplots(2, (len(names) + 1) // 2, figsize=(4.2 * ((len(names) + 1) // 2), 7.5))
    for ax, name in zip(axes.flat, names):
        g = df[df.layer == name]
        b = g.batch
        for col, lab, c in (("f", "forward", "C0"), ("b", "backward", "C3")):
            ax.plot(b, g[f"{col}_measured"] / b * 1e3, "o", color=c, label=f"{lab} measured")
            ax.plot(b, g[f"{col}_model"] / b * 1e3, "-", color=c, label=f"{lab} model")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{name} ({g.set.iloc[0]})", fontsize=9)
        ax.set_xlabel("batch")
        ax.set_ylabel("ms per sample")
        ax.grid(alpha=0.3, which="both")
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle("One transformer layer on a V100 (fp32): measured (Chimera) vs the kernel cost model", fontsize=10)
    save_figure(fig, out)


def run(out_dir, quick: bool = False) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ms = load_measurements()
    preset = ms.device.kernels
    fitted, rms = fit_constants(ms)
    rows = error_table(ms, fitted)
    errs = pd.DataFrame(rows)
    ms_cols = ["f_measured", "f_model", "b_measured", "b_model"]
    show = errs.copy()
    show[ms_cols] = show[ms_cols] * 1e3
    show = show.rename(columns={c: c + "_ms" for c in ms_cols})
    write_csv(show, out / "errors.csv")
    sp = pd.DataFrame(speedups(ms, fitted))
    write_csv(sp, out / "speedups.csv")
    summ = summary(rows)
    plot(ms, rows, out / "cost_curves.png")
    preset_rows = error_table(ms, preset)
    preset_summ = summary(preset_rows)
    held = summ[summ.group == "held-out"].iloc[0] if ms.held_out else summ[summ.group == "fit"].iloc[0]
    sp_held = sp[sp.set == "held-out"] if ms.held_out else sp
    ok_median = held.median_abs_error <= AIM_MEDIAN
    ok_speed = bool((sp_held.fb_error.abs() <= AIM_SPEEDUP).all())
    sp_err = {k: float(sp_held[f"{k}_error"].abs().max()) for k in ("f", "b", "fb")}
    const = pd.DataFrame([{"constant": k, "fitted": v, "preset": getattr(preset, k)}
                          for k, v in fitted.to_dict().items()])
    parts = ["# Kernel cost model vs measured layer times (V100, fp32)", "",
             f"Measurements: Chimera's released single-layer profiles ({', '.join(l.name for l in ms.layers)}), "
             f"forward and backward time per pass against the batch, under the benchmark's protocol "
             f"({ms.protocol.passes} forward passes, then as many backward passes, no input gradient). Constants "
             f"fitted on {', '.join(ms.fit)} (rms log error {rms:.3f}); held out: {', '.join(ms.held_out) or 'none'}.",
             "",
             f"**Held-out: median |error| {held.median_abs_error:.1%}, max {held.max_abs_error:.1%}** (aim: median <= "
             f"{AIM_MEDIAN:.0%}: {'met' if ok_median else 'NOT met'}); per-sample speed-up from the smallest to the "
             f"largest batch within {sp_err['fb']:.1%} of measured for F + B on the held-out layers (aim <= "
             f"{AIM_SPEEDUP:.0%}: {'met' if ok_speed else 'NOT met'}); forward alone within {sp_err['f']:.1%}, "
             f"backward alone within {sp_err['b']:.1%}. The linear cost model has a speed-up of 1.0 by "
             f"construction (measured F + B: {sp.fb_measured.min():.2f}x - {sp.fb_measured.max():.2f}x).",
             "", "## Error summary (|model / measured - 1|, F and B points)", "", markdown(summ, ".3f"), "",
             "## Per-sample speed-up from the smallest to the largest batch", "",
             markdown(sp[["layer", "set", "from", "to", "f_measured", "f_model", "b_measured", "b_model", "fb_measured",
                     "fb_model", "fb_error"]], ".3f"), "",
             "## Fitted constants (and the v100 preset's)", "", markdown(const, ".4g"), "",
             "With the preset's constants the held-out median |error| is "
             f"{_median_of(preset_summ, 'held-out' if ms.held_out else 'fit'):.1%}.",
             "", "## Errors per layer and batch (errors.csv; figure: cost_curves.png)", "",
             markdown(show[["layer", "set", "batch", "f_measured_ms", "f_model_ms", "f_error", "b_measured_ms",
                            "b_model_ms", "b_error"]], ".3f")]
    if not quick:
        cf = cross_family(ms)
        write_csv(cf, out / "cross_family.csv")
        parts += ["", "## Cross-family hold-out (refit on two families, test on the third)", "",
                  markdown(cf, ".3f"), "",
                  "A family left out of the fit has kernels the fit never saw priced (T5's eager RMSNorm, OPT's "
                  "clamp over the s = 2048 scores, BERT's module-heavy Python): this is the harder test."]
    parts += ["", "What the model leaves out: the host times are one number per kernel (and per module call) "
              "although Python's cost differs from op to op; the tile efficiencies are one curve for every GEMM "
              "kernel; nothing depends on clocks, power or caches between kernels. The constants are fp32 SIMT "
              "on one V100 host: fp16 tensor cores and other GPUs are not calibrated by these files."]
    report = "\n".join(parts)
    write_output(out / "report.md", report + "\n", "report")
    return report


def _median_of(summary, group: str) -> float:
    return summary[summary.group == group].median_abs_error.iloc[0]
