"""Stage placements shared by schedule families: which device holds stage k of a model copy."""
from __future__ import annotations


def v_stages(D: int) -> list[int]:
    """One V-shaped copy of 2D stages (ZB-V, DualPipe-V, each copy of BitPipe): stage k < D on
    device k and stage k >= D on device 2D-1-k, so device d holds stages d and 2D-1-d and the V
    turn (stage D-1 -> D) stays on device D-1."""
    return [k if k < D else 2 * D - 1 - k for k in range(2 * D)]


def mirrored(copy: list[int], D: int) -> list[int]:
    """The same copy run from the other end of the device line (device d -> D-1-d)."""
    return [D - 1 - d for d in copy]


def v_placement(D: int) -> list[list[int]]:
    """Two opposite V-shaped copies of 2D stages each (BitPipe): the down copy is :func:`v_stages`,
    the up copy its mirror. Device d holds down stages d, 2D-1-d and up stages D-1-d, D+d; each
    V turn stays on one device."""
    down = v_stages(D)
    return [down, mirrored(down, D)]


def straight_placement(D: int) -> list[list[int]]:
    """Two opposite straight copies of D stages (Chimera)."""
    straight = list(range(D))
    return [straight, mirrored(straight, D)]
