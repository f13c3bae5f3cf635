"""``pipetwin presets``: the model, cluster and device presets, one line each (the names -m/-c take;
a long one wraps under itself within 120 columns). A model's line ends with its parameters, total
and active (the ones a token passes through: a mixture of experts' k routed experts of E; = total
for a dense model), from :func:`cost_models.transformer.model_params` and
:func:`cost_models.transformer.active_params`. ``--json`` prints one object: ``models`` (each spec's
fields with ``parameters`` and ``active_parameters``), ``paper_models`` (the planner's layer-cost
models), ``clusters`` and ``devices`` (their fields)."""
from __future__ import annotations

import textwrap

from .common import print_json
from .tables import WIDTH

NAME = "presets"
HELP = "list the model, cluster and device presets (the names --model / --cluster take), one line each"


def add_arguments(p):
    p.add_argument("kind", nargs="?", choices=["models", "clusters", "devices"], help="only this kind")
    p.add_argument("--json", action="store_true", help="print one JSON object (models with total and active "
                                                       "parameters)")


def _count(n: float) -> str:
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _models():
    """(name, spec, total parameters, active parameters) of every model preset."""
    from cost_models import load_model, model_presets
    from cost_models.transformer import active_params, model_params
    return [(name, m, model_params(m), active_params(m)) for name, m in ((n, load_model(n)) for n in model_presets())]


def _paper_models() -> list[str]:
    try:   # the planner's layer-cost models (pipetwin plan only)
        from cost_models.workloads.paper_models import paper_models
        return list(paper_models())
    except ImportError:
        return []


def _structure(m) -> str:
    """The block's attention and MLP in words (after its heads): ", ffn F" for a dense one (when F is
    not 4h); latent attention, q/k norms, experts (E x width, top-k, shared, router, leading dense blocks)."""
    parts = []
    if m.is_mla:
        q = f"q rank {m.q_lora_rank}, " if m.q_lora_rank else ""
        parts.append(f"latent attention ({q}kv rank {m.kv_lora_rank}, rope {m.rope_head_dim})")
    if m.qk_norm:
        parts.append("q/k norms")
    if not m.is_moe:
        parts += [f"ffn {m.ffn}"] if m.ffn != 4 * m.hidden else []
    else:
        parts.append(f"{m.experts} experts of {m.expert_width}, top-{m.top_k}")
        if m.shared_ffn:
            parts.append(f"shared {m.shared_ffn}" + (" gated" if m.shared_gate else ""))
        if m.router != "softmax":
            parts.append(f"{m.router} router")
        if m.dense_layers:
            parts.append(f"first {m.dense_layers} dense (ffn {m.ffn})")
    return "".join(f", {p}" for p in parts)


def _model_lines() -> list[tuple[str, str]]:
    out = []
    for name, m, total, active in _models():
        heads = f"{m.heads} heads" + (f" of {m.head_dim}" if m.head_size is not None else "") + \
            (f" ({m.kv} kv)" if m.kv != m.heads else "")
        out.append((name, f"{m.kind}, {m.layers} layers, h {m.hidden}, {heads}{_structure(m)}, s {m.seq_len}, "
                          f"V {m.vocab}, b {m.micro_batch}: {_count(total)} parameters, {_count(active)} active"))
    out += [(name, "DAPPLE paper model (layer costs): pipetwin plan only") for name in _paper_models()]
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
        eff = "" if d.calibrated else ", no efficiency (kernel model only)" if d.efficiency is None else \
            f", efficiency {d.efficiency:g}"
        out.append((name, f"{mem}, {flops}{eff}" + (f"; {d.fitted}" if d.fitted else "")))
    return out


def _json(kind: str | None) -> dict:
    from cost_models import cluster_presets, device_presets, load_cluster, load_device
    out = {}
    if kind in (None, "models"):
        out["models"] = [{**m.to_dict(), "name": name, "parameters": total, "active_parameters": active}
                         for name, m, total, active in _models()]
        out["paper_models"] = _paper_models()
    if kind in (None, "clusters"):
        out["clusters"] = [{**load_cluster(n).to_dict(), "name": n} for n in cluster_presets()]
    if kind in (None, "devices"):
        out["devices"] = [{**load_device(n).to_dict(), "name": n} for n in device_presets()]
    return out


def main(args) -> int:
    if args.json:
        print_json(_json(args.kind))
        return 0
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
