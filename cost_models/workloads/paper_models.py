"""The DAPPLE paper's models as workloads, approximated from their published layer sizes (names are
resolved, with the transformer presets, by :func:`cost_models.workloads.workload_sources.load_workload`).

DAPPLE (Fan et al., PPoPP 2021) evaluates its planner on VGG-19, GNMT-16, BERT-48, XLNet-36 and
AmoebaNet-36. The transformers come from :mod:`cost_models.transformer` (BERT-48 is the
``bert-48`` preset; XLNet-36 is a BERT-style encoder of 36 layers, h 1024, 16 heads, sequence 512,
vocabulary 32000, two-stream attention ignored). The other three are layer stacks defined here from
their layer shapes, per sample, with 2 FLOPs per multiply-accumulate and backward = 2 x forward
(input gradient = weight gradient = forward):

* **VGG-19** (Simonyan & Zisserman, 2015) on 224 x 224 images: 16 3x3 convolutions (64, 64 | 128,
  128 | 256 x 4 | 512 x 4 | 512 x 4, a 2x2 max-pool after each group, folded into the layer before
  it) and 3 fully connected layers (25088 -> 4096 -> 4096 -> 1000): 143.7 M parameters, 39 GFLOP
  (19.6 G multiply-accumulates) forward per image. Activations kept: the layer's input and its pre-activation output.
* **GNMT-16** (Wu et al., 2016, 16 LSTM layers): source and target embeddings (vocabulary 32000,
  h 1024), 8 encoder and 8 decoder LSTM layers (h 1024; an LSTM layer is 4 gates of
  ``h x (in + h)``), attention folded into the first decoder layer, the softmax projection
  (h x 32000); 50 tokens per sentence on each side. About 0.24 B parameters. The encoder-decoder is
  planned as a chain: a decoder-side stage boundary carries the encoder outputs too.
* **AmoebaNet-36** (Real et al., 2019; GPipe's AmoebaNet-D layout): a stem, 36 normal cells in 3
  groups of 12 (filters F, 2F, 4F with F = 512 on 28 x 28, 14 x 14, 7 x 7 feature maps), two
  reduction cells between the groups, and the classifier. A cell is modelled as ``12 F^2``
  parameters (its separable and 1x1 convolutions) applied at every position, keeping 8 feature maps
  for the backward. About 0.8 B parameters.

CNN and RNN models train in fp32 (4-byte activations and gradients, the device's fp32 peak);
transformers in fp16 (the cost_models default). Static memory is 16 bytes per parameter for the
fp16 models (mixed-precision Adam) and 16 for fp32 ones as well (weights, gradients, two Adam
moments in fp32).
"""
from __future__ import annotations

import dataclasses

from ..base import LayerCosts
from ..profile import scaled_layer_costs
from ..device import DeviceSpec
from ..model_spec import ModelSpec

from .workload import WORKLOAD_FIELDS, Workload, from_layer_costs, transformer_workload

XLNET_36 = ModelSpec(name="xlnet-36", layers=36, hidden=1024, heads=16, seq_len=512, vocab=32000, kind="bert")
FP32 = 4


def _layers(rows, device: DeviceSpec, precision: str, name: str) -> tuple[LayerCosts, tuple[str, ...]]:
    """rows: (name, forward FLOPs, params, activation bytes kept, output bytes), per sample."""
    rate = device.achievable_flops(precision)
    f = tuple(r[1] / rate for r in rows)
    lc = LayerCosts(f=f, b_input=f, w=f, act=tuple(float(r[3]) for r in rows),
                    act_w=tuple(float(r[3]) / 2 for r in rows), out_bytes=tuple(float(r[4]) for r in rows),
                    params=tuple(float(r[2]) for r in rows), bytes_per_param_static=16.0,
                    grad_bytes_per_param=float(FP32),
                    optim_time_per_param=(28.0 / device.memory_bandwidth) if device.memory_bandwidth else 0.0)
    return lc, tuple(r[0] for r in rows)


def vgg19_rows() -> list[tuple]:
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
    rows, c_in, hw, i = [], 3, 224, 0
    for k, v in enumerate(cfg):
        if v == "M":
            continue
        pooled = k + 1 < len(cfg) and cfg[k + 1] == "M"
        out_hw = hw // 2 if pooled else hw
        flops = 2.0 * hw * hw * c_in * v * 9
        params = 9 * c_in * v + v
        act = FP32 * (c_in * hw * hw + v * hw * hw)
        i += 1
        rows.append((f"conv{i}", flops, params, act, FP32 * v * out_hw * out_hw))
        c_in, hw = v, out_hw
    dims = [c_in * hw * hw, 4096, 4096, 1000]
    for n, (a, b) in enumerate(zip(dims, dims[1:])):
        rows.append((f"fc{n + 1}", 2.0 * a * b, a * b + b, FP32 * (a + b), FP32 * b))
    return rows


def gnmt16_rows(h: int = 1024, vocab: int = 32000, tokens: int = 50) -> list[tuple]:
    T = tokens
    lstm_params = 4 * h * (2 * h) + 8 * h
    lstm_flops = 2.0 * T * 4 * h * 2 * h
    lstm_act = FP32 * T * 6 * h            # gates, cell and hidden state per token
    seq = FP32 * T * h                    # one hidden sequence
    rows = [("src_embedding", 0.0, vocab * h, FP32 * T, seq)]
    rows += [(f"encoder{i}", lstm_flops, lstm_params, lstm_act, seq) for i in range(8)]
    # from here on a boundary carries the encoder outputs and the decoder sequence
    rows += [("tgt_embedding", 0.0, vocab * h, FP32 * T, 2 * seq)]
    attn_flops = 2.0 * 2 * T * T * h + 2.0 * T * h * h
    rows += [("decoder0", lstm_flops + attn_flops, lstm_params + h * h, lstm_act + FP32 * T * T, 2 * seq)]
    rows += [(f"decoder{i}", lstm_flops, lstm_params, lstm_act, 2 * seq) for i in range(1, 8)]
    rows += [("softmax", 2.0 * T * h * vocab, h * vocab + vocab, FP32 * T * vocab, 0.0)]
    return rows


def amoebanet36_rows(F: int = 512, cells_per_group: int = 12) -> list[tuple]:
    rows = []
    hw0 = 28
    stem_out = FP32 * F * hw0 * hw0
    rows.append(("stem", 2.0 * 112 * 112 * 3 * 64 * 9 + 2.0 * hw0 * hw0 * 64 * F * 9, 3 * 64 * 9 + 64 * F * 9,
                 FP32 * (3 * 224 * 224 + 64 * 112 * 112), stem_out))
    for g in range(3):
        Fg, hw = F * 2 ** g, hw0 // 2 ** g
        p = 12 * Fg * Fg
        for c in range(cells_per_group):
            # a cell reads the two previous cells' outputs: a boundary carries both
            rows.append((f"cell{g * cells_per_group + c}", 2.0 * p * hw * hw, p, FP32 * 8 * Fg * hw * hw,
                         FP32 * 2 * Fg * hw * hw))
        if g < 2:
            p = 12 * Fg * (2 * Fg)
            rows.append((f"reduction{g}", 2.0 * p * (hw // 2) ** 2, p, FP32 * 8 * Fg * hw * hw,
                         FP32 * 2 * (2 * Fg) * (hw // 2) ** 2))
    Fl = 4 * F
    rows.append(("classifier", 2.0 * Fl * 1000, Fl * 1000 + 1000, FP32 * Fl * 49, 0.0))
    return rows


_ROWS = {"vgg-19": vgg19_rows, "gnmt-16": gnmt16_rows, "amoebanet-36": amoebanet36_rows}
PAPER_MODELS = ("vgg-19", "gnmt-16", "amoebanet-36", "xlnet-36")


def paper_models() -> list[str]:
    return list(PAPER_MODELS)


def paper_workload(name: str, device: DeviceSpec, recompute: str = "none", cost_model: str = "linear") -> Workload:
    """One of :data:`PAPER_MODELS` on ``device`` (per sample). ``cost_model="kernels"``: the
    per-sample times at each micro-batch from the kernels of :mod:`cost_models.workloads.paper_kernels`."""
    src = {"kind": "paper", "name": name, "recompute": recompute, "cost_model": cost_model}
    if name == "xlnet-36":
        return transformer_workload(XLNET_36, device, recompute, source=src, cost_model=cost_model)
    if name not in _ROWS:
        raise ValueError(f"unknown paper model {name!r}; choose one of {', '.join(PAPER_MODELS)}")
    if recompute != "none":
        raise ValueError(f"recomputation is only modelled for transformers; {name} takes --recompute none")
    lc, names = _layers(_ROWS[name](), device, "fp32", name)
    wl = from_layer_costs(name, lc, layer_names=names, memory_capacity=device.memory_bytes, source=src)
    if cost_model == "linear":
        return wl
    curve = kernel_curve(name, device)
    f, b, w = curve(1)
    return dataclasses.replace(wl, f=f, b_input=b, w=w, cost_model=cost_model, per_sample_at=curve)


def kernel_curve(name: str, device: DeviceSpec, precision: str = "fp32"):
    """q -> per-sample (f, b_input, w) per layer of a CNN/RNN paper model under the kernel model."""
    from ..kernels import DeviceRates

    from .paper_kernels import KERNELS
    rates = DeviceRates.of(device, precision)
    n_rows = len(_ROWS[name]())

    def curve(q: int):
        layers = KERNELS[name](int(q))
        if len(layers) != n_rows:   # pragma: no cover - the two descriptions must agree
            raise AssertionError(f"{name}: {len(layers)} kernel layers vs {n_rows} rows")
        t = [rates.phases(ks) for ks in layers]
        return tuple(x[0] / q for x in t), tuple(x[1] / q for x in t), tuple(x[2] / q for x in t)
    return curve


def calibrated_workload(profile, device: DeviceSpec | None = None) -> Workload:
    """A calibration profile's model (``pipetwin calibrate``: a transformer spec or a user's layer
    stack, ``PATH.py:FUNC``) as a workload: the measured per-layer costs divided by the profile's
    micro-batch (per sample: the planner takes costs as linear in the micro-batch, here an
    approximation of measured ones), on the profile's own host (``device`` None) or scaled onto
    ``device`` (:func:`cost_models.scaled_layer_costs`). Its ``source`` record (kind
    ``calibrated``) carries the per-sample costs themselves, so a plan file rebuilds it without the
    profile (:func:`calibrated_from_source`)."""
    if device is None:
        lc, cap = profile.layer_costs(), profile.memory_bytes
    else:
        lc, cap = scaled_layer_costs(profile, device)[0], device.memory_bytes
    names = profile.model.layer_names if profile.is_stack else \
        ("embedding", *[f"block{i}" for i in range(profile.model.layers)], "head")
    work = from_layer_costs(profile.model_name, lc, per=profile.micro_batch, layer_names=names, memory_capacity=cap)
    src = {"kind": "calibrated", "name": profile.model_name, "profile": profile.name, "stack": profile.is_stack,
           "workload": {f: list(v) if isinstance(v, tuple) else v for f in WORKLOAD_FIELDS
                        if f != "source" for v in [getattr(work, f)]}}
    if not profile.is_stack:
        src["spec"] = profile.model.to_dict()
    return dataclasses.replace(work, source=src)


def calibrated_from_source(source: dict) -> Workload:
    """The workload of a ``calibrated`` source record (the inverse of :func:`calibrated_workload`)."""
    w = dict(source.get("workload") or {})
    missing = [f for f in WORKLOAD_FIELDS if f != "source" and f not in w]
    if missing:
        raise ValueError(f"plan file: the calibrated workload misses {', '.join(missing)}")
    return Workload(**{k: tuple(v) if isinstance(v, list) else v for k, v in w.items()}, source=dict(source))
