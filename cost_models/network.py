"""The network the simulator moves bytes over: which links a message between two ranks crosses.

A message from rank a to rank b occupies every link on ``path(a, b)`` for its whole transfer;
transfers that share a link share its bandwidth (the simulator's fair-share flows). A link's
time for S bytes alone is latency + S / bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float   # bytes per second
    latency: float     # seconds


class Network(Protocol):
    def path(self, src: int, dst: int) -> list[Link]: ...


@dataclass(frozen=True)
class PortNetwork:
    """Every rank has one full-duplex port (``bandwidth`` each way, ``latency``) into a
    non-blocking switch: a message crosses the sender's out-port and the receiver's in-port."""

    bandwidth: float
    latency: float = 0.0

    def path(self, src: int, dst: int) -> list[Link]:
        return [Link(f"r{src}.out", self.bandwidth, self.latency), Link(f"r{dst}.in", self.bandwidth, 0.0)]
