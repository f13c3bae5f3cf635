"""The expert-parallel all-to-all (:mod:`executor.expert_parallel`) on 2-4 spawned gloo processes:
uneven and zero row counts; the rows each rank receives equal the concatenation, in source-rank
order, of block e of every rank's input done by hand; the gradients equal the same concatenation's
gradients (the reverse exchange); the asynchronous issue gives the same rows and gradients."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.expert_parallel import NO_EP, ExpertParallel

H = 3


def _table(world: int) -> list[list[int]]:
    """counts[s][e]: rows rank s sends to rank e; uneven, with zeros (rank 0 sends nothing to the
    last rank, the last rank sends nothing at all to rank 1)."""
    t = [[(s * 2 + e * 3 + 1) % 4 for e in range(world)] for s in range(world)]
    t[0][world - 1] = 0
    t[world - 1][1 % world] = 0
    return t


def _rows(s: int, counts: list[int]) -> torch.Tensor:
    """Rank s's rows: row i of the block for rank e is (s, e, i) spread over H columns."""
    rows = [torch.tensor([100.0 * s + 10.0 * e + i + 0.5 * c for c in range(H)])
            for e, n in enumerate(counts) for i in range(n)]
    return torch.stack(rows) if rows else torch.zeros(0, H)


def _weights(e: int, n: int) -> torch.Tensor:
    """The upstream gradient of rank e's received rows (a loss sum(y * w))."""
    return torch.arange(n * H, dtype=torch.float32).reshape(n, H) * (e + 1) + 0.25


def _worker(rank: int, world: int, path: str, async_op: bool):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        ep = ExpertParallel(world, rank, group, tuple(range(world)))
        table = _table(world)
        x = _rows(rank, table[rank]).requires_grad_(True)
        if async_op:
            handle = ep.start_all_to_all(x, table[rank])
            y, recv = handle.wait()
        else:
            y, recv = ep.all_to_all(x, table[rank])
        # by hand: block `rank` of every source's rows, in source order
        want = torch.cat([_rows(s, table[s])[sum(table[s][:rank]):sum(table[s][:rank + 1])] for s in range(world)])
        assert recv == [table[s][rank] for s in range(world)], (recv, table)
        assert torch.equal(y, want), (y, want)
        (y * _weights(rank, y.shape[0])).sum().backward()
        # by hand: x's block for rank e is at offset sum(table[:rank][e]) of rank e's received rows
        grads = []
        for e in range(world):
            w = _weights(e, sum(table[s][e] for s in range(world)))
            off = sum(table[s][e] for s in range(rank))
            grads.append(w[off:off + table[rank][e]])
        assert torch.equal(x.grad, torch.cat(grads)), (x.grad, grads)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,async_op", [(2, False), (3, True), (4, False), (4, True)])
def test_uneven_all_to_all_rows_and_gradients(world, async_op):
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, os.path.join(d, "store"), async_op), nprocs=world,
                           start_method="spawn")


def test_size_one_is_the_identity():
    x = torch.randn(5, H, requires_grad=True)
    y, recv = NO_EP.all_to_all(x, [5])
    assert y is x and recv == [5]
    assert NO_EP.start_all_to_all(x, [5]).wait() == (x, [5])
    assert list(ExpertParallel(2, 1, None, (0, 1)).experts(8)) == [4, 5, 6, 7]


@pytest.mark.parametrize("counts,msg", [
    ([2, 3], "an all-to-all over 1 EP ranks needs 1 row counts >= 0; got [2, 3]"),
    ([-1], "an all-to-all over 1 EP ranks needs 1 row counts >= 0; got [-1]"),
    ([4], "send counts [4] sum to 4; the all-to-all was given 5 rows"),
])
def test_bad_counts_refused(counts, msg):
    with pytest.raises(ValueError) as e:
        NO_EP.all_to_all(torch.zeros(5, H), counts)
    assert str(e.value) == msg
