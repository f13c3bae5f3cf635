"""Expert parallelism: the EP group of a process and its differentiable, uneven all-to-all.

This is the size-1 version of the interface the ``ep-exec`` part of issue 42 implements
(``docs``: the seam in the issue's notes): :class:`ExpertParallel` ``(size, rank, group, ranks)``,
:data:`NO_EP`, :meth:`ExpertParallel.all_to_all` and :meth:`ExpertParallel.start_all_to_all`. At
size 1 both return ``(x, send_counts)`` unchanged and issue nothing; the MoE MLP
(:mod:`executor.moe`) calls them so that the same code runs with EP > 1. EP rank e holds the routed
experts ``[e E/EP, (e+1) E/EP)`` (Megatron's contiguous order) under the whole model's names.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class AllToAllHandle:
    """An all-to-all in flight: ``wait()`` -> (rows, recv_counts)."""

    def __init__(self, out: torch.Tensor, recv_counts: list[int], work=None):
        self._out, self._recv, self._work = out, recv_counts, work

    def wait(self) -> tuple[torch.Tensor, list[int]]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._out, self._recv


@dataclass(frozen=True)
class ExpertParallel:
    """A process's expert-parallel group: ``size`` EP ranks (``ranks``: global ranks in EP order),
    this process being EP rank ``rank``; ``group`` the torch process group (None at size 1)."""

    size: int = 1
    rank: int = 0
    group: object = None
    ranks: tuple[int, ...] = ()

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"EP rank {self.rank} of an EP group of {self.size}")

    def experts(self, num_experts: int) -> range:
        """The global indices of the routed experts this EP rank holds (contiguous, Megatron's order)."""
        if num_experts % self.size:
            raise ValueError(f"EP {self.size} does not divide the {num_experts} experts")
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def all_to_all(self, x: torch.Tensor, send_counts) -> tuple[torch.Tensor, list[int]]:
        """Rows ``x`` sorted by destination EP rank, ``send_counts[e]`` to rank e: the rows received
        in source-rank order and their counts. Differentiable (backward: the reverse exchange)."""
        return self.start_all_to_all(x, send_counts).wait()

    def start_all_to_all(self, x: torch.Tensor, send_counts, async_op: bool = True) -> AllToAllHandle:
        """:meth:`all_to_all` issued asynchronously: ``handle.wait()`` -> (rows, recv_counts)."""
        send = [int(c) for c in send_counts]
        if len(send) != self.size or sum(send) != x.shape[0]:
            raise ValueError(f"send counts {send} for {x.shape[0]} rows over {self.size} EP ranks")
        if self.size != 1:
            raise NotImplementedError("this is the size-1 interface; the EP exchange is executor/expert_parallel.py "
                                      "of the ep-exec branch")
        return AllToAllHandle(x, send)


NO_EP = ExpertParallel()
