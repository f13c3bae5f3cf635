"""A straggler in a real run (``--slowdown RANK=FACTOR``, the simulator's knob): the slowed rank
sleeps (FACTOR - 1) x each F, B and W it measured, inside the op's trace row; the arithmetic is
untouched, so losses and weights equal the single-process reference."""
import pytest
import torch

from cost_models.job import Faults
from executor.config import RunConfig
from executor.launch import run
from executor.reference import run_reference
from tests.helpers import assert_losses_equal, params_by_name

BASE = dict(schedule="zb-h1", devices=2, microbatches=4, steps=3, optimizer="sgd", lr=0.05, collect_params=True,
            timeout=30.0)


def _busy(trace, rank):
    """Seconds of rank's F, B and W rows after the first step."""
    t = trace[(trace.device == rank) & (trace.step > 0) & trace.kind.isin(["F", "B", "W"])]
    return float((t.end - t.start).sum())


def test_slowed_rank_takes_factor_times_and_trains_the_same():
    """D = 2, N = 4, zb-h1, rank 1 slowed 3x: the run's losses and parameters are the reference's (SGD,
    within 1e-6, as every split-backward run) and bit for bit the unslowed run's; rank 1's F, B and W
    take 3x the unslowed run's in all (within 1: two runs on a host of two cores shared by other
    work differ by up to a third in their op times), rank 0's 1x (within 0.5)."""
    cfg = RunConfig.of(**BASE, faults=Faults(slowdown=((1, 3.0),)))
    plain = run(RunConfig.of(**BASE))
    slow = run(cfg)
    ref = run_reference(cfg)
    assert_losses_equal(slow, ref)
    assert slow.losses == plain.losses
    for name, tensors in params_by_name(slow).items():
        assert max(float((t - ref.params[name]).abs().max()) for t in tensors) <= 1e-6, name
        assert all(torch.equal(t, p) for t, p in zip(tensors, params_by_name(plain)[name])), name
    assert _busy(slow.trace, 1) / _busy(plain.trace, 1) == pytest.approx(3.0, abs=1.0)
    assert _busy(slow.trace, 0) / _busy(plain.trace, 0) == pytest.approx(1.0, abs=0.5)


@pytest.mark.parametrize("faults,match", [
    (Faults(slowdown=((2, 2.0),)), r"--slowdown 2=\.\.\.: the run has ranks 0\.\.1"),
    (Faults(jitter=0.1), "drop --slow-link, --jitter"),
])
def test_what_a_run_cannot_emulate_is_refused(faults, match):
    with pytest.raises(ValueError, match=match):
        RunConfig.of(**BASE, faults=faults)
