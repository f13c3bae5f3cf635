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


def test_slowed_rank_takes_factor_times_and_trains_the_same():
    """D = 2, N = 4, zb-h1, rank 1 slowed 3x: the run's losses and parameters are the reference's (SGD,
    within 1e-6, as every split-backward run) and bit for bit the unslowed run's. How long the slowed
    rank's ops take is not asserted here (a timed test on a shared host: the ratio of ratios measured
    0.83 to 5.10 under load); the sleep itself is exact with a fake clock
    (:func:`test_slow_down_sleeps_the_factor_less_one_times_the_op`)."""
    cfg = RunConfig.of(**BASE, faults=Faults(slowdown=((1, 3.0),)))
    plain = run(RunConfig.of(**BASE))
    slow = run(cfg)
    ref = run_reference(cfg)
    assert_losses_equal(slow, ref)
    assert slow.losses == plain.losses
    for name, tensors in params_by_name(slow).items():
        assert max(float((t - ref.params[name]).abs().max()) for t in tensors) <= 1e-6, name
        assert all(torch.equal(t, p) for t, p in zip(tensors, params_by_name(plain)[name])), name


def test_slow_down_sleeps_the_factor_less_one_times_the_op():
    """An op started at 10.0 s and measured done at 10.25 s on a rank slowed 3x sleeps 2 x 0.25 = 0.5 s."""
    from executor.runtime import slow_down
    asked = []
    assert slow_down(3.0, 10.0, clock=lambda: 10.25, sleep=asked.append) == 0.5
    assert asked == [0.5]


@pytest.mark.parametrize("faults,match", [
    (Faults(slowdown=((2, 2.0),)), r"--slowdown 2=\.\.\.: the run has ranks 0\.\.1"),
    (Faults(jitter=0.1), "drop --slow-link, --jitter"),
])
def test_what_a_run_cannot_emulate_is_refused(faults, match):
    with pytest.raises(ValueError, match=match):
        RunConfig.of(**BASE, faults=faults)


def test_a_mixed_cluster_becomes_the_slower_pools_slowdowns():
    """run --cluster a100-h100 (llama3-8b, T = 8, D = 4: ranks 0, 1 on the A100 pool, 2, 3 on the H100
    pool, the by-pool device map): the job's faults are pool_slowdowns', each A100 rank's F + B + W on
    an A100 over the same ops on an H100 (2.00 and 2.00, the kernel model's ratio for these stages;
    rank 0 holds the embedding, which is memory-bound, so its ratio differs in the third digit), its
    partition the typed split (6, 5, 12, 11): about half the layers on each A100 stage, as the ratio
    2 says), and the cluster is gone; a one-pool cluster gives none."""
    from cost_models import Job, Layout
    from cost_models.bind import pool_slowdowns
    from cost_models.parallel import Parallel
    cfg = RunConfig.of(schedule="dapple", devices=4, microbatches=8, model="llama3-8b", tp=8, cluster="a100-h100")
    slow = cfg.job.faults.slowdown
    assert [r for r, _ in slow] == [0, 1]
    assert [round(k, 3) for _, k in slow] == [1.993, 2.003]
    assert cfg.job.partition == (6, 5, 12, 11)
    assert cfg.job.cluster.name is None
    job = Job(layout=Layout(schedule="dapple", devices=4, microbatches=8), model="llama3-8b",
              cluster="dgx-a100-4x8-ib", parallel=Parallel(tp=8))
    assert pool_slowdowns(job) is None
