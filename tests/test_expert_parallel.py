"""The expert-parallel all-to-all (:mod:`executor.expert_parallel`) on 2-4 spawned gloo processes:
uneven and zero row counts; the rows each rank receives equal the concatenation, in source-rank
order, of block e of every rank's input done by hand; the gradients equal the same concatenation's
gradients (the reverse exchange); the asynchronous issue gives the same rows and gradients. An
emulated wire (``--a2a-wire``) changes nothing but the sleeps, which a fake clock states exactly."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.expert_parallel import NO_EP, AllToAllHandle, ExpertParallel, wire_wait

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


WIRE = 1.0e6      # bytes/s of the emulated wire
NOW = 7.0         # the fake clock: the exchange is issued and waited for at the same instant


def _worker(rank: int, world: int, path: str, async_op: bool, wire: float | None = None):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        slept = []
        ep = ExpertParallel(world, rank, group, tuple(range(world)), wire=wire, clock=lambda: NOW,
                            sleep=slept.append)
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
        # the wire: the forward sleeps the bytes rank sends (its rows, own included) / WIRE, the
        # backward the bytes of its received rows' gradient / WIRE; the fake clock never advances,
        # so each wait sleeps all of it (an exchange of 0 bytes, and the counts' exchange, nothing)
        sent, got = sum(table[rank]) * H * 4, sum(recv) * H * 4
        want = [b / WIRE for b in (sent, got) if b] if wire else []
        assert slept == pytest.approx(want, abs=1e-12), (slept, sent, got)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,async_op,wire", [(2, False, None), (3, True, None), (4, False, None),
                                                (4, True, None), (2, True, WIRE), (3, False, WIRE)])
def test_uneven_all_to_all_rows_and_gradients(world, async_op, wire):
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, os.path.join(d, "store"), async_op, wire), nprocs=world,
                           start_method="spawn")


def test_the_wire_sleeps_what_is_left_of_its_time_after_the_exchange():
    """An exchange issued at 10.0 s whose wire takes 0.5 s: waited for at 10.2 s (the other micro-batch's
    segment ran meanwhile) it sleeps 0.3 s; at 10.7 s (the segment took longer) nothing; once only."""
    asked = []
    assert wire_wait(10.5, clock=lambda: 10.2, sleep=asked.append) == pytest.approx(0.3, abs=1e-15)
    assert wire_wait(10.5, clock=lambda: 10.7, sleep=asked.append) == 0.0
    assert wire_wait(None, clock=lambda: 0.0, sleep=asked.append) == 0.0
    assert asked == [pytest.approx(0.3, abs=1e-15)]
    x = torch.zeros(2, H)
    h = AllToAllHandle(x, [2], None, due=10.5, clock=lambda: 10.25, sleep=asked.append)
    assert h.wait() == (x, [2]) and h.wait() == (x, [2])
    assert asked[1:] == [0.25] and h.slept == 0.25
    with pytest.raises(ValueError, match="bandwidth > 0"):
        ExpertParallel(2, 0, None, (0, 1), wire=0.0)


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


def _counts_round_worker(rank: int, world: int, path: str):
    import executor.expert_parallel as xp
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))
        now, slept = [NOW], []
        real = xp.exchange_counts

        def counts_round(send, g, device):    # the counts' round takes 0.25 s on the fake clock
            out = real(send, g, device)
            now[0] += 0.25
            return out
        xp.exchange_counts = counts_round
        ep = ExpertParallel(world, rank, group, tuple(range(world)), wire=WIRE_SLOW, clock=lambda: now[0],
                            sleep=slept.append)
        table = _table(world)
        x = _rows(rank, table[rank]).requires_grad_(True)
        y, recv = ep.start_all_to_all(x, table[rank]).wait()
        (y * _weights(rank, y.shape[0])).sum().backward()
        sent, got = sum(table[rank]) * H * 4, sum(recv) * H * 4
        # forward: due = NOW + sent / W (read before the counts' round), waited at NOW + 0.25; the
        # backward has no counts' round: all of got / W
        want = [sent / WIRE_SLOW - 0.25] + ([got / WIRE_SLOW] if got else [])   # 0 bytes: no sleep
        assert slept == pytest.approx(want, abs=1e-12), (slept, sent, got)
    finally:
        dist.destroy_process_group()


WIRE_SLOW = 10.0     # bytes/s: every exchange's wire seconds exceed the counts' round's 0.25 s


def test_the_wire_counts_from_the_exchange_s_start_its_counts_round_included():
    """An exchange's seconds are max(gloo, S / W) with gloo its counts' round + its rows (what the
    calibration's all-to-all fit measures, :meth:`cost_models.profile.CalibrationProfile.a2a_times`):
    the wire's clock starts before the counts' round, not after it (which made a forward exchange
    take counts + max(rows, S / W) in the run: the counts' in-run round, ~1 ms over gloo on a loaded
    host, paid outside the wire the simulator hides it under). World 2: rank 0 sends 1 row of H = 3
    fp32 (12 bytes: 1.2 s on 10 B/s, 0.95 s slept), rank 1 3 rows (36 bytes: 3.35 s slept); the
    backward returns rank 0's 4 received rows (48 bytes: 4.8 s), rank 1's none (no sleep)."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_counts_round_worker, args=(2, os.path.join(d, "store")), nprocs=2, start_method="spawn")
