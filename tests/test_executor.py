"""Executor pieces that need no process group: model split, init, data, memory meter, B/W split."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from cost_models.model_spec import load_model
from cost_models.partition import block_ranges
from cost_models.transformer import block_flops
from executor.backward import SplitBackward, full_backward, weight_backward
from executor.config import RunConfig, lowered_schedule
from executor.data import TokenSource
from executor.device import SavedTensorMeter, select_device
from executor.model import Block, full_model, stage_module
from executor.recompute import Recompute
from schedules import ScheduleError

SPEC = load_model("tiny")


def test_partition_is_contiguous_and_covers_all_layers():
    for L, S in [(8, 2), (8, 8), (10, 4), (9, 4), (7, 3)]:
        parts = block_ranges(L, S)
        assert [r.start for r in parts[1:]] == [r.stop for r in parts[:-1]]
        assert parts[0].start == 0 and parts[-1].stop == L
        sizes = [len(r) for r in parts]
        assert max(sizes) - min(sizes) <= 1
    # extra layers go to inner stages first: the ends also carry embedding / head
    assert [len(r) for r in block_ranges(10, 4)] == [2, 3, 3, 2]


def test_partition_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match="at least 16 layers"):
        block_ranges(8, 16)


@pytest.mark.parametrize("S", [2, 4, 8])
def test_stage_weights_equal_full_model_weights(S):
    full = dict(full_model(SPEC, seed=3).named_parameters())
    seen = set()
    for s in range(S):
        for name, p in stage_module(SPEC, S, s, seed=3).named_parameters():
            assert torch.equal(p, full[name]), name
            seen.add(name)
    assert seen == set(full)
    other = dict(full_model(SPEC, seed=4).named_parameters())
    assert not torch.equal(other["blocks.0.fc.weight"], full["blocks.0.fc.weight"])


def test_stages_compose_to_the_full_model():
    x, y = TokenSource(SPEC, 0).batch(0, 0, 1)
    h = x
    for s in range(4):
        h = stage_module(SPEC, 4, s, seed=0)(h)
    assert torch.allclose(h, full_model(SPEC, seed=0)(x), rtol=1e-5, atol=1e-6)


def test_data_is_deterministic_and_learnable(tmp_path):
    src = TokenSource(SPEC, 7)
    a, b = src.batch(2, 5, 8), TokenSource(SPEC, 7).batch(2, 5, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == (SPEC.micro_batch, SPEC.seq_len) and a[0].dtype == torch.int64
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(src.batch(2, 6, 8)[0], a[0])
    f = tmp_path / "text.txt"
    f.write_bytes(b"hello pipeline world " * 20)
    tx, ty = TokenSource(SPEC, 0, str(f)).batch(0, 1, 2)
    assert tx.max() < SPEC.vocab and torch.equal(tx[:, 1:], ty[:, :-1])
    with pytest.raises(FileNotFoundError):
        TokenSource(SPEC, 0, str(tmp_path / "missing.txt"))


def test_saved_tensor_meter_counts_each_storage_once_and_releases():
    lin = torch.nn.Linear(16, 16)
    meter = SavedTensorMeter(list(lin.parameters()))
    x = torch.randn(4, 16, requires_grad=True)
    with meter.capture():
        h = lin(x)            # saves x (the weight is a parameter: not counted)
        y = (h * h).sum()     # saves h twice: one storage
    assert meter.current() == x.numel() * 4 + h.numel() * 4
    y.backward()
    assert meter.current() == 0
    assert meter.peak == x.numel() * 4 + h.numel() * 4


class _AtenCounter(TorchDispatchMode):
    """Counts aten ops and the matmul FLOPs (2 per multiply-accumulate) run inside it."""

    def __init__(self):
        super().__init__()
        self.ops, self.flops = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in ("mm", "addmm", "addmm_"):
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def _norm_params(module) -> set:
    return {id(p) for m in module.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}


def _grads(module, x, g, *, split=None, autocast=False):
    """(input grad, parameter grads) of one forward + backward, full or through ``split``
    (B then W); B must leave every gradient but the norms' untouched."""
    params = list(module.parameters())
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    gg = g.to(out.dtype)
    if split is None:
        full_backward(out, gg)
        return x.grad, [p.grad.clone() for p in params]
    gx, pending = split.input(out, x, gg)
    norms = _norm_params(module)
    assert all((p.grad is None) != (id(p) in norms) for p in params), "B computed linear weight gradients"
    del out
    weight_backward(pending)
    return gx, [p.grad.clone() for p in params]


def test_split_backward_equals_full_backward_and_w_runs_only_weight_kernels():
    """B then W (executor.backward) equals the full backward on a pipeline stage (2 blocks),
    micro-batch after micro-batch (the graph is analysed once, then replayed), and the FLOPs
    split exactly as the formulas say: B the input-gradient FLOPs, W the weight-gradient FLOPs
    (2 x rows x weights of the linear layers), no attention, GeLU or norm backward in W (the norms'
    per-channel parameters come with B, from their fused kernel)."""
    torch.manual_seed(0)
    stage = stage_module(SPEC, 4, 1, seed=0)
    x = torch.randn(SPEC.micro_batch, SPEC.seq_len, SPEC.hidden)
    g = torch.randn_like(x)
    gx_full, full = _grads(stage, x, g)
    split = SplitBackward(stage.parameters())
    for _ in range(3):
        gx, got = _grads(stage, x, g, split=split)
        assert torch.equal(gx, gx_full)
        for a, b in zip(got, full):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)
    assert split.analyses == 1
    # what B and W run
    stage.zero_grad(set_to_none=False)
    xx = x.clone().requires_grad_()
    out = stage(xx)
    with FlopCounterMode(display=False) as fc_b, _AtenCounter() as in_b:
        _, pending = split.input(out, xx, g)
    del out
    with _AtenCounter() as in_w:
        weight_backward(pending)
    _, _, flops_w = block_flops(SPEC)
    blocks = len(stage.blocks)
    xx = x.clone().requires_grad_()
    out = stage(xx)
    with FlopCounterMode(display=False) as fc_dx:             # the input gradient alone, as torch counts it
        torch.autograd.grad(out, (xx,), g)
    assert fc_b.get_total_flops() == fc_dx.get_total_flops()  # attention backward included
    assert in_b.flops == blocks * flops_w                   # the linear layers' input gradients
    assert in_w.flops == blocks * flops_w                   # and their weight gradients, in W only
    for kernel in ("_scaled_dot_product_flash_attention_for_cpu_backward", "gelu_backward", "mm",
                   "native_layer_norm_backward"):
        assert in_w.ops[kernel] == 0, kernel
    assert in_w.ops["addmm_"] == in_w.ops["addmv_"] == 4 * blocks      # each linear's weight and bias
    assert in_b.ops["native_layer_norm_backward"] == 2 * blocks


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_split_backward_of_convolutions_frees_the_graph_and_w_runs_only_weight_gradients(autocast):
    """A conv stack (a user's model file): B then W equals the full backward; W gets each
    convolution's weight and bias gradients from its saved input (no engine group, so B frees the
    graph), and W runs convolution_backward once per convolution with the input's gradient masked
    off: W's FLOPs equal the closed form 2 x outputs x (in channels x k x k) per weight."""
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Conv2d(8, 4, 3, padding=1, bias=False))
    x = torch.randn(2, 3, 8, 8)
    g = torch.randn(2, 4, 4, 4)
    gx_full, full = _grads(mod, x, g, autocast=autocast)
    split = SplitBackward(mod.parameters())
    for _ in range(2):
        gx, got = _grads(mod, x, g, split=split, autocast=autocast)
        assert torch.equal(gx, gx_full)
        for a, b in zip(got, full):
            assert (a - b).abs().max() <= (4e-3 if autocast else 1e-6) * b.abs().max()
    _, _, ops, groups, _ = split._template
    assert groups == [] and [op.fast[0] for op in ops] == ["convolution", "convolution"]
    xx = x.clone().requires_grad_()
    out = mod(xx)
    _, pending = split.input(out, xx, g)
    assert pending.full is None and all(node is None for _, node, _, _ in pending.ops)   # no graph kept
    del out
    with FlopCounterMode(display=False) as fc_w:
        weight_backward(pending)
    assert fc_w.get_total_flops() == 2 * (2 * 8 * 8 * 8) * (3 * 9) + 2 * (2 * 4 * 4 * 4) * (8 * 9)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_split_backward_of_the_first_stage_ends_b_at_the_lookups(mode):
    """The first stage (token ids in: no input gradient): B runs the blocks' input backward down
    to the two lookups, computes the tables' gradients there (embedding_dense_backward, twice) and
    frees the graph; W the linear layers' weight gradients. Gradients equal the full backward's;
    B's FLOPs equal the blocks' input-gradient FLOPs (as on a later stage) and W's their
    weight-gradient FLOPs, with no attention, GeLU, norm or lookup backward in W; what waits from
    B to W is the blocks' (8 + 2m) sbh x 4 bytes (the ledger's: the embedding keeps nothing for W),
    with and without full recomputation."""
    from cost_models.transformer import embedding_layer
    torch.manual_seed(0)
    stage = stage_module(SPEC, 2, 0, seed=0)
    params = list(stage.parameters())
    b, s, h = SPEC.micro_batch, SPEC.seq_len, SPEC.hidden
    tok = torch.randint(0, SPEC.vocab, (b, s), generator=torch.Generator().manual_seed(1))
    out = stage(tok)
    g = torch.randn_like(out)
    full_backward(out, g)
    ref = [p.grad.clone() for p in params]
    meter = SavedTensorMeter(params)
    Recompute(mode, meter, params).install(stage)
    split = SplitBackward(params, lazy=mode != "none")
    blocks = len(stage.blocks)
    _, _, flops_w = block_flops(SPEC)
    want_held = blocks * (8 + 2 * SPEC.ffn_mult) * b * s * h * 4
    assert embedding_layer(SPEC).act_w_bytes == 0
    x = stage.embed(tok).detach().requires_grad_()
    y = x
    for block in stage.blocks.values():
        y = block(y)
    with FlopCounterMode(display=False) as fc_dx:     # the blocks' input backward, as torch counts it
        torch.autograd.grad(y, (x,), g)
    want_b = fc_dx.get_total_flops()                  # (with full recomputation B re-runs F: counted too)
    del x, y
    for _ in range(3):
        stage.zero_grad(set_to_none=True)
        with meter.capture():
            out = stage(tok)
        with FlopCounterMode(display=False) as fc_b, _AtenCounter() as in_b:
            gx, pending = split.input(out, None, g)
        assert gx is None and pending.full is None and all(node is None for _, node, _, _ in pending.ops)
        b_params = _norm_params(stage) | {id(p) for p in stage.embed.parameters()}
        assert all((p.grad is None) != (id(p) in b_params) for p in params), "B computed a linear's weight gradient"
        held = meter.hold(pending.tensors())
        del out
        assert meter.current() == want_held
        with FlopCounterMode(display=False) as fc_w, _AtenCounter() as in_w:
            weight_backward(pending)
        del pending, held
        assert meter.current() == 0
        for p, r in zip(params, ref):
            assert torch.allclose(p.grad, r, rtol=1e-6, atol=1e-9)
        assert fc_w.get_total_flops() == blocks * flops_w
        assert in_b.ops["embedding_dense_backward"] == 2 and in_w.ops["embedding_dense_backward"] == 0
        for kernel in ("_scaled_dot_product_flash_attention_for_cpu_backward", "gelu_backward",
                       "native_layer_norm_backward"):
            assert in_w.ops[kernel] == 0 and in_b.ops[kernel] > 0, kernel
        assert fc_b.get_total_flops() == want_b
    assert split.analyses == 1


class _Shared(torch.nn.Module):
    """One block applied twice, a linear layer used twice and a scale used twice in elementwise
    products (an op without a direct recipe: W falls back to the engine for that group)."""

    def __init__(self, spec):
        super().__init__()
        self.block = Block(spec)
        self.lin = torch.nn.Linear(spec.hidden, spec.hidden)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, spec.hidden))

    def forward(self, x):
        x = self.lin(self.block(x)) * self.scale
        x = self.block(x)
        return self.lin(x) * 0.5 + x * self.scale


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_split_backward_with_parameters_used_twice(autocast):
    torch.manual_seed(0)
    mod = _Shared(SPEC)
    x = torch.randn(SPEC.micro_batch, SPEC.seq_len, SPEC.hidden)
    g = torch.randn_like(x)
    gx_full, full = _grads(mod, x, g, autocast=autocast)
    split = SplitBackward(mod.parameters())
    for _ in range(2):
        gx, got = _grads(mod, x, g, split=split, autocast=autocast)
        assert torch.equal(gx, gx_full)
        # fp32: the same sums in another order; bf16: the full backward sums a shared weight's two
        # uses in bf16 (one autocast copy), the split in fp32
        tol = 4e-3 if autocast else 1e-6
        for a, b in zip(got, full):
            assert (a - b).abs().max() <= tol * b.abs().max()
    assert split.analyses == 1
    _, _, ops, groups, _ = split._template
    assert len(groups) == 1 and {ops[i].node_type.__name__ for i in groups[0]} >= {"MulBackward0"}


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("split", [False, True], ids=["full-backward", "split-backward"])
def test_recompute_keeps_less_and_changes_no_gradient(mode, split):
    """Per block, full recomputation keeps the block's input (sbh x 4 bytes), selective drops the
    attention's log-sum-exp (the fused kernel keeps no s^2 tensor: b a s x 4 bytes); a split
    backward keeps (8 + 2m) sbh x 4 bytes from B to W; gradients are bit-identical to no
    recomputation; everything is released after the backward."""
    torch.manual_seed(0)
    stage = stage_module(SPEC, 4, 1, seed=0)
    params = list(stage.parameters())
    x0 = torch.randn(SPEC.micro_batch, SPEC.seq_len, SPEC.hidden)
    g = torch.randn_like(x0)
    _, ref = _grads(stage, x0, g)
    meter = SavedTensorMeter(params)
    with meter.capture():
        out = stage(x0.clone().requires_grad_())
    kept_none = meter.current()
    del out
    Recompute(mode, meter, params).install(stage)
    stage.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    with meter.capture():
        out = stage(x)
    kept = meter.current()
    b, s, h, a = SPEC.micro_batch, SPEC.seq_len, SPEC.hidden, SPEC.heads
    blocks = len(stage.blocks)
    assert kept == (blocks * b * s * h * 4 if mode == "full" else kept_none - blocks * b * a * s * 4)
    if split:
        gx, pending = SplitBackward(params, lazy=True).input(out, x, g)
        held = meter.hold(pending.tensors())
        del out
        # what waits for W: the inputs of the linear layers and the gradients of their outputs,
        # (8 + 2m) sbh d per block (the zero-bubble paper's M_W), recomputed or not
        assert meter.current() == blocks * (8 + 2 * SPEC.ffn_mult) * b * s * h * 4
        weight_backward(pending)
        del pending, held
    else:
        full_backward(out, g)
        del out
    assert meter.current() == 0
    for p, r in zip(params, ref):
        assert torch.equal(p.grad, r)


def test_plan_validates_before_anything_starts():
    with pytest.raises(ScheduleError, match="even number of devices"):
        lowered_schedule(RunConfig.of(schedule="chimera", devices=3, microbatches=3))
    with pytest.raises(ValueError, match="layers"):
        # 16 stages > 8 layers
        lowered_schedule(RunConfig.of(schedule="interleaved", devices=4, microbatches=4, chunks=4))
    with pytest.raises(ValueError, match="optimizer"):
        RunConfig.of(optimizer="lamb")
    low = lowered_schedule(RunConfig.of(schedule="bitpipe", devices=2, microbatches=4, replicas=2))
    assert low.lowered and low.num_ranks == 4


def test_device_selection_on_cpu():
    ctx = select_device("cpu")
    assert ctx.backend == "gloo" and ctx.device.type == "cpu"
    if not torch.cuda.is_available():
        assert select_device("auto").backend == "gloo"
        with pytest.raises(ValueError, match="CUDA is not available"):
            select_device("cuda")
