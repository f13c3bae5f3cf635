"""Executor pieces that need no process group: model split, init, data, memory meter, B/W split."""
import pytest
import torch

from cost_models.model_spec import load_model
from cost_models.partition import block_ranges
from executor.config import RunConfig, lowered_schedule
from executor.data import TokenSource
from executor.device import SavedTensorMeter, select_device
from executor.model import full_model, stage_module
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


def test_split_backward_equals_full_backward():
    """B = autograd.grad w.r.t. the input (graph kept), then W = grads of the parameters."""
    torch.manual_seed(0)
    stage = stage_module(SPEC, 4, 1, seed=0)
    x = torch.randn(SPEC.micro_batch, SPEC.seq_len, SPEC.hidden)
    g = torch.randn_like(x)

    x1 = x.clone().requires_grad_()
    out = stage(x1)
    torch.autograd.backward(out, g)
    full = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)

    x2 = x.clone().requires_grad_()
    out = stage(x2)
    (gx,) = torch.autograd.grad(out, (x2,), g, retain_graph=True)
    gw = torch.autograd.grad(out, list(stage.parameters()), g)
    assert torch.equal(gx, x1.grad)
    for a, b in zip(gw, full):
        assert torch.equal(a, b)


def test_plan_validates_before_anything_starts():
    with pytest.raises(ScheduleError, match="even number of devices"):
        lowered_schedule(RunConfig(schedule="chimera", devices=3, microbatches=3))
    with pytest.raises(ValueError, match="layers"):
        lowered_schedule(RunConfig(schedule="interleaved", devices=4, microbatches=4, chunks=4))  # 16 stages > 8 layers
    with pytest.raises(ValueError, match="optimizer"):
        RunConfig(optimizer="lamb")
    low = lowered_schedule(RunConfig(schedule="bitpipe", devices=2, microbatches=4, replicas=2))
    assert low.lowered and low.num_ranks == 4


def test_device_selection_on_cpu():
    ctx = select_device("cpu")
    assert ctx.backend == "gloo" and ctx.device.type == "cpu"
    if not torch.cuda.is_available():
        assert select_device("auto").backend == "gloo"
        with pytest.raises(ValueError, match="CUDA is not available"):
            select_device("cuda")
