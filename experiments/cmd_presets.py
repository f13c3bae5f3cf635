"""``pipetwin presets``: the model, cluster and device presets, one line each (the names -m/-c take;
a long one wraps under itself within 120 columns)."""
from __future__ import annotations

import textwrap

from .tables import WIDTH

NAME = "presets"
HELP = "list the model, cluster and device presets (the names --model / --cluster take), one line each"


def add_arguments(p):
    p.add_argument("kind", nargs="?", choices=["models", "clusters", "devices"], help="only this kind")


def _count(n: float) -> str:
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _model_lines() -> list[tuple[str, str]]:
    from cost_models import load_model, model_presets
    from cost_models.transformer import model_params
    out = []
    for name in model_presets():
        m = load_model(name)
        heads = f"{m.heads} heads" + (f" ({m.kv} kv)" if m.kv != m.heads else "")
        ffn = f", ffn {m.ffn}" if m.ffn != 4 * m.hidden else ""
        out.append((name, f"{m.kind}, {m.layers} layers, h {m.hidden}, {heads}{ffn}, s {m.seq_len}, V {m.vocab}, "
                          f"b {m.micro_batch}: {_count(model_params(m))} parameters"))
    try:   # the planner's layer-cost models (pipetwin plan only)
        from cost_models.workloads.paper_models import paper_models
        for name in paper_models():
            out.append((name, "DAPPLE paper model (layer costs): pipetwin plan only"))
    except ImportError:
        pass
    return out


def _cluster_lines() -> list[tuple[str, str]]:
    from cost_models import cluster_presets, load_cluster
    out = []
    for name in cluster_presets():
        c = load_cluster(name)
        out.append((name, c.describe().split(": ", 1)[1] + f" ({c.num_devices} devices)"))
    return out


def _device_lines() -> list[tuple[str, str]]:
    from cost_models import device_presets, load_device
    from experiments.tables import fmt_bytes
    out = []
    for name in device_presets():
        d = load_device(name)
        peaks = dict(d.peak_flops)
        shown = [p for p in ("bf16", "fp16", "fp8", "fp32") if p in peaks][:3]
        flops = (f"{'/'.join(shown)} {'/'.join(f'{peaks[p] / 1e12:g}' for p in shown)} TFLOP/s" if shown
                 else "no datasheet FLOP/s")
        mem = fmt_bytes(d.memory_bytes) if d.memory_bytes else "memory unknown"
        out.append((name, f"{mem}, {flops}, efficiency {d.efficiency:g}"))
    return out


def main(args) -> int:
    kinds = {"models": _model_lines, "clusters": _cluster_lines, "devices": _device_lines}
    for kind, lines in kinds.items():
        if args.kind not in (None, kind):
            continue
        rows = lines()
        width = max(len(n) for n, _ in rows)
        own = "or a YAML file of your own" + (" or a Hugging Face config.json; h hidden, s sequence, V vocabulary, "
                                           "b micro-batch" if kind == "models" else "")
        print(f"{kind} ({own}):")
        indent = width + 4
        for name, what in rows:       # a long description goes on under itself, within WIDTH columns
            lines = textwrap.wrap(what, WIDTH - indent) or [""]
            print(f"  {name.ljust(width)}  {lines[0]}")
            for more in lines[1:]:
                print(" " * indent + more)
    return 0
