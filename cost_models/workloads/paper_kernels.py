"""The kernels of the DAPPLE paper's CNN/RNN models (:mod:`cost_models.workloads.paper_models`) at a micro-batch, for
the kernel cost model (:mod:`cost_models.kernels`).

Each function returns, for ``q`` samples, one kernel list per layer of the matching ``*_rows``
function of :mod:`cost_models.workloads.paper_models` (same order, same count), fp32 as those models train:

* **VGG-19**: a 3x3 convolution as cuDNN's implicit GEMM (forward ``[q h w x c_out]`` of depth
  ``9 c_in``, data gradient ``[q h w x c_in]`` of depth ``9 c_out`` (not for the first layer: the
  image needs no gradient), filter gradient ``[c_out x 9 c_in]`` of depth ``q h w``), its bias,
  ReLU and (where the row folds one in) 2x2 max-pool as memory-bound kernels; the fully connected
  layers as GEMMs with ReLU and dropout; the loss after the last.
* **GNMT-16**: an LSTM layer as cuDNN runs it: one GEMM for the input projection of all T tokens,
  then T steps of a ``[q x 4h]`` recurrent GEMM of depth h and a point-wise gate kernel; backward the
  same steps in reverse and the weight gradients as two GEMMs of depth ``q T``; the first decoder
  layer adds the attention (two batched GEMMs over the T x T scores and the softmax); embeddings
  are a lookup and a scatter into the table's gradient; the softmax layer is the ``[q T x V]``
  projection and the log-softmax loss.
* **AmoebaNet-36**: a cell as 12 point-wise (1 x 1) convolutions of its F channels (its 12 F^2
  parameters, the same FLOPs as :func:`cost_models.workloads.paper_models.amoebanet36_rows`), 4 depth-wise
  convolutions and 12 batch-norm / ReLU / add passes over its feature maps; reduction cells the
  same at half the resolution with twice the channels; the stem's two convolutions; the classifier.

Every layer with parameters also accumulates its gradients (one kernel per parameter tensor),
as every micro-batch after the first does.
"""
from __future__ import annotations

from ..kernels import Kernel, conv2d, gemm, memory

D = 4          # fp32


def _accum(name: str, params: list[int]) -> list[Kernel]:
    return [memory(f"{name}.grad.accum{i}", "W", 3 * p * D) for i, p in enumerate(params)]


def vgg19_kernels(q: int) -> list[list[Kernel]]:
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
    out, c_in, hw, first = [], 3, 224, True
    for k, v in enumerate(cfg):
        if v == "M":
            continue
        pooled = k + 1 < len(cfg) and cfg[k + 1] == "M"
        n = f"conv{len(out) + 1}"
        y = q * v * hw * hw * D
        ks = conv2d(n, "F", q, hw, hw, c_in, v, 3, D)
        ks[0] = Kernel(ks[0].name, "F", ks[0].bytes, ks[0].gemm, modules=1)
        ks += [memory(f"{n}.bias", "F", 2 * y), memory(f"{n}.relu", "F", 2 * y, modules=1)]
        if pooled:
            ks += [memory(f"{n}.pool", "F", y + y / 4 + y / 4, modules=1)]
            ks += [memory(f"{n}.pool.bwd", "B", y / 4 + y / 4 + y)]
        ks += [memory(f"{n}.relu.bwd", "B", 3 * y)]
        if not first:
            ks += conv2d(n, "B", q, hw, hw, c_in, v, 3, D)
        ks += conv2d(n, "W", q, hw, hw, c_in, v, 3, D) + [memory(f"{n}.db", "W", y)]
        ks += _accum(n, [9 * c_in * v, v])
        out.append(ks)
        c_in, hw, first = v, hw // 2 if pooled else hw, False
    dims = [c_in * hw * hw, 4096, 4096, 1000]
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        n = f"fc{i + 1}"
        ks = [gemm(n, "F", q, b, a, D, modules=1)]
        last = i == len(dims) - 2
        y = q * b * D
        if not last:
            ks += [memory(f"{n}.relu", "F", 2 * y, modules=1), memory(f"{n}.dropout", "F", 2 * y + q * b, modules=1),
                   memory(f"{n}.dropout.bwd", "B", 2 * y + q * b), memory(f"{n}.relu.bwd", "B", 3 * y)]
        else:
            ks += [memory("loss", "F", 3 * y, modules=1), memory("loss.bwd", "B", 3 * y)]
        ks += [gemm(f"{n}.dx", "B", q, a, b, D), gemm(f"{n}.dw", "W", b, a, q, D), memory(f"{n}.db", "W", y)]
        ks += _accum(n, [a * b, b])
        out.append(ks)
    return out


def _lstm(name: str, q: int, T: int, h: int, n_in: int) -> list[Kernel]:
    g = q * 4 * h * D
    ks = [gemm(f"{name}.x", "F", q * T, 4 * h, n_in, D, modules=1)]
    for t in range(T):
        ks += [gemm(f"{name}.h{t}", "F", q, 4 * h, h, D), memory(f"{name}.gates{t}", "F", 2 * g + 3 * q * h * D)]
    for t in reversed(range(T)):
        ks += [memory(f"{name}.gates{t}.bwd", "B", 3 * g + 3 * q * h * D), gemm(f"{name}.dh{t}", "B", q, h, 4 * h, D)]
    ks += [gemm(f"{name}.dx", "B", q * T, n_in, 4 * h, D), gemm(f"{name}.dw_ih", "W", 4 * h, n_in, q * T, D),
           gemm(f"{name}.dw_hh", "W", 4 * h, h, q * T, D), memory(f"{name}.db", "W", g * T)]
    return ks + _accum(name, [4 * h * n_in, 4 * h * h, 8 * h])


def gnmt16_kernels(q: int, h: int = 1024, vocab: int = 32000, tokens: int = 50) -> list[list[Kernel]]:
    T = tokens
    x = q * T * h * D

    def embed(name):
        return [memory(f"{name}.lookup", "F", 2 * x + 8 * q * T, modules=1),
                memory(f"{name}.grad.zero", "W", vocab * h * D), memory(f"{name}.scatter", "W", 3 * x + 8 * q * T)] \
            + _accum(name, [vocab * h])

    out = [embed("src_embedding")]
    out += [_lstm(f"encoder{i}", q, T, h, h) for i in range(8)]
    out += [embed("tgt_embedding")]
    s = q * T * T * D
    attn = [gemm("attn.q", "F", q * T, h, h, D, modules=1), gemm("attn.scores", "F", T, T, h, D, batch=q),
            memory("attn.softmax", "F", 2 * s), gemm("attn.ctx", "F", T, h, T, D, batch=q),
            gemm("attn.ctx.dp", "B", T, T, h, D, batch=q), gemm("attn.ctx.dv", "B", T, h, T, D, batch=q),
            memory("attn.softmax.bwd", "B", 3 * s), gemm("attn.scores.dq", "B", T, h, T, D, batch=q),
            gemm("attn.scores.dk", "B", T, h, T, D, batch=q), gemm("attn.q.dx", "B", q * T, h, h, D),
            gemm("attn.q.dw", "W", h, h, q * T, D)] + _accum("attn", [h * h])
    out += [_lstm("decoder0", q, T, h, h) + attn]
    out += [_lstm(f"decoder{i}", q, T, h, h) for i in range(1, 8)]
    z = q * T * vocab * D
    out += [[gemm("softmax.proj", "F", q * T, vocab, h, D, modules=1), memory("softmax.logsoftmax", "F", 2 * z),
             memory("softmax.loss", "F", z, modules=1), memory("softmax.bwd", "B", 3 * z),
             gemm("softmax.dx", "B", q * T, h, vocab, D), gemm("softmax.dw", "W", vocab, h, q * T, D),
             memory("softmax.db", "W", z)] + _accum("softmax", [h * vocab, vocab])]
    return out


def _cell(name: str, q: int, hw: int, c_in: int, c_out: int, first: bool = False) -> list[Kernel]:
    """12 point-wise convolutions c_in -> c_out at hw x hw output, 4 depth-wise, 12 norm/act passes."""
    M = q * hw * hw
    y = M * c_out * D
    ks = []
    for i in range(12):
        ks += [gemm(f"{name}.pw{i}", "F", M, c_out, c_in, D, modules=1)]
    ks += [memory(f"{name}.dw{i}", "F", 2 * y, modules=1) for i in range(4)]
    ks += [memory(f"{name}.bn{i}", "F", 2 * y, modules=1) for i in range(12)]
    ks += [memory(f"{name}.bn{i}.bwd", "B", 3 * y) for i in range(12)]
    ks += [memory(f"{name}.dw{i}.bwd", "B", 3 * y) for i in range(4)]
    if not first:
        ks += [gemm(f"{name}.pw{i}.dx", "B", M, c_in, c_out, D) for i in range(12)]
    ks += [gemm(f"{name}.pw{i}.dw", "W", c_out, c_in, M, D) for i in range(12)]
    ks += [memory(f"{name}.bn{i}.dgb", "W", 2 * y) for i in range(12)]
    return ks + _accum(name, [c_in * c_out] * 12)


def amoebanet36_kernels(q: int, F: int = 512, cells_per_group: int = 12) -> list[list[Kernel]]:
    hw0 = 28
    stem = (conv2d("stem.conv0", "F", q, 112, 112, 3, 64, 3, D) + conv2d("stem.conv1", "F", q, hw0, hw0, 64, F, 3, D)
            + [memory("stem.bn", "F", 2 * q * 64 * 112 * 112 * D, modules=1),
               memory("stem.bn.bwd", "B", 3 * q * 64 * 112 * 112 * D)]
            + conv2d("stem.conv1", "B", q, hw0, hw0, 64, F, 3, D)
            + conv2d("stem.conv0", "W", q, 112, 112, 3, 64, 3, D) + conv2d("stem.conv1", "W", q, hw0, hw0, 64, F, 3, D)
            + _accum("stem", [27 * 64, 576 * F]))
    out = [stem]
    for g in range(3):
        Fg, hw = F * 2 ** g, hw0 // 2 ** g
        for c in range(cells_per_group):
            out.append(_cell(f"cell{g * cells_per_group + c}", q, hw, Fg, Fg))
        if g < 2:
            out.append(_cell(f"reduction{g}", q, hw // 2, Fg, 2 * Fg))
    Fl = 4 * F
    out.append([memory("classifier.pool", "F", q * Fl * 49 * D, modules=1),
                gemm("classifier", "F", q, 1000, Fl, D, modules=1), memory("loss", "F", 3 * q * 1000 * D, modules=1),
                memory("loss.bwd", "B", 3 * q * 1000 * D), gemm("classifier.dx", "B", q, Fl, 1000, D),
                memory("classifier.pool.bwd", "B", q * Fl * 50 * D), gemm("classifier.dw", "W", 1000, Fl, q, D)]
               + _accum("classifier", [Fl * 1000, 1000]))
    return out


KERNELS = {"vgg-19": vgg19_kernels, "gnmt-16": gnmt16_kernels, "amoebanet-36": amoebanet36_kernels}
