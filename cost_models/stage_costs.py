"""A user's own stage costs (``--stage-costs FILE.yaml``): what a profiler reports per pipeline stage.

The format::

    stages:            # one entry per pipeline stage (or a single entry for every stage), seconds
      - {f: 0.0185, b: 0.0181, w: 0.0093}   # b = input-gradient backward, w = weight-gradient
    message: 0.0006    # one activation or gradient transfer between adjacent stages, seconds
    activation: 1.0e9  # optional: bytes one stage keeps per micro-batch (memory in bytes, else in Ma)
    activation_w: 0.4e9  # optional: of those, the bytes W still needs after B (split schedules; else all)
    blocking_sends: true # optional: a send holds its sender for the message time (else it is posted)

Times are seconds (plain numbers or e.g. ``18.5 ms``); ``activation`` bytes (or e.g. ``1 GiB``).
A pipeline stage is one device's share of the model (D entries for D devices, as a profiler of a
D-stage run reports them). A schedule with S stages per copy (v chunks per device: S = v D) gives
each stage the entry of the device that holds it, scaled by D / S (the device's layers split
evenly over its chunks); a single entry stands for every device. A
schedule with a full backward (1F1B, GPipe, ...) runs B = b + w; a split one runs b and w.

Messages: each activation or gradient message takes ``message`` seconds (a fixed latency, no
bandwidth shared). A send is posted and the sender goes on (``blocking_sends: false``, the default,
what the Zero Bubble paper's scheduler assumes), or it holds the sender for those seconds
(``blocking_sends: true``: a synchronous send, as a run that waits on each of its P2P calls). Memory:
a micro-batch keeps ``activation`` (else 1 Ma) per full stage from F until its B frees all but
``activation_w`` (default: all of it), which its W frees (without a split B frees it all), as the
unit cost model does; weights are not counted (the
file does not give them) and gradient all-reduces are not modelled, so data-parallel replicas
(``--dp`` > 1) are refused.
"""
from __future__ import annotations

from dataclasses import dataclass

from schedules.ir import Schedule

from ._spec import SpecError, check_fields, mapping, read_yaml, seconds, size_bytes
from .base import StageCosts, _table
from .network import PortNetwork

FIELDS = ("stages", "message", "activation", "activation_w", "blocking_sends")
STAGE_FIELDS = ("f", "b", "w")
_NO_BANDWIDTH_LIMIT = 1e30     # messages carry no bytes here: their time is the latency alone


@dataclass(frozen=True)
class StageTimes:
    """A stage-costs file, read: per pipeline stage ``f``, ``b`` (input-gradient backward), ``w``
    (weight-gradient) in seconds (one entry: every stage), ``message`` seconds, ``activation``
    bytes per stage and micro-batch (None: memory in Ma), ``activation_w`` the bytes of it W keeps
    after B (None: all), ``blocking_sends`` whether a send holds its sender for ``message``,
    ``source`` the file."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    message: float
    activation: float | None = None
    activation_w: float | None = None
    blocking_sends: bool = False
    source: str = "stage costs"

    @property
    def entries(self) -> int:
        return len(self.f)

    def check_devices(self, devices: int) -> None:
        """The file's entries must be one or one per pipeline device."""
        if self.entries not in (1, devices):
            raise ValueError(f"--stage-costs {self.source} has {self.entries} stage entries for -D {devices}: give one "
                             f"entry per pipeline stage ({devices}) or a single entry for every stage")

    def per_device(self, devices: int) -> list[tuple[float, float, float]]:
        """(f, b, w) of each of ``devices`` full pipeline stages."""
        self.check_devices(devices)
        rows = list(zip(self.f, self.b, self.w))
        return rows * devices if self.entries == 1 else rows

    def bind(self, sched: Schedule) -> StageCosts:
        """The costs of every (copy, stage) of ``sched`` (the module docstring's mapping)."""
        D, S, C = sched.num_devices, sched.num_stages, sched.num_copies
        if sched.replicas > 1:
            raise ValueError(f"--stage-costs gives no gradient sizes, so --dp {sched.replicas} replicas cannot be "
                             f"all-reduced; use --dp 1")
        full = self.per_device(D)
        scale = D / S
        rows = [[full[sched.placement[c][s]] for s in range(S)] for c in range(C)]
        f = [[r[0] * scale for r in row] for row in rows]
        if sched.split_backward:
            b, w = [[r[1] * scale for r in row] for row in rows], [[r[2] * scale for r in row] for row in rows]
        else:
            b, w = [[(r[1] + r[2]) * scale for r in row] for row in rows], [[0.0] * S] * C
        act_unit = self.activation if self.activation is not None else 1.0
        act = [act_unit * scale] * S
        kept = act_unit if self.activation_w is None else self.activation_w
        act_w = [kept * scale] * S if sched.split_backward else [0.0] * S
        zeros = [0.0] * S
        t = lambda v: _table([v] * C)  # noqa: E731
        return StageCosts(time_unit="s", mem_unit="B" if self.activation is not None else "Ma",
                          f=_table(f), b=_table(b), w=_table(w), act=t(act), act_w=t(act_w), act_bytes=t(zeros),
                          grad_bytes=t(zeros), param_bytes=t(zeros), static_mem=tuple([0.0] * sched.num_ranks),
                          optim_time=tuple([0.0] * sched.num_ranks),
                          send_time=self.message if self.blocking_sends else 0.0,
                          meta={"model": f"stage costs {self.source}"})

    def network(self) -> PortNetwork:
        """Every message takes ``message`` seconds: on the wire, or in its sender with blocking sends
        (then it arrives as the send returns)."""
        return PortNetwork(bandwidth=_NO_BANDWIDTH_LIMIT, latency=0.0 if self.blocking_sends else self.message)


def load_stage_costs(path) -> StageTimes:
    """Read and check a stage-costs file (:class:`~cost_models._spec.SpecError`, one line naming
    the file and field)."""
    data, source = read_yaml(path, "stage-costs", "stage-costs")
    data = mapping(data, source)
    check_fields(data, source, FIELDS, required=("stages", "message"))
    stages = data["stages"]
    if not isinstance(stages, list) or not stages:
        raise SpecError(f"{source}: field 'stages' must be a non-empty list of {{f, b, w}} entries; got {stages!r}")
    f, b, w = [], [], []
    for i, entry in enumerate(stages):
        where = f"stages[{i}]"
        entry = mapping(entry, source, where)
        check_fields(entry, source, STAGE_FIELDS, required=STAGE_FIELDS, prefix=f"{where}.")
        f.append(seconds(entry["f"], source, f"{where}.f", allow_zero=False))
        b.append(seconds(entry["b"], source, f"{where}.b", allow_zero=False))
        w.append(seconds(entry["w"], source, f"{where}.w", allow_zero=True))
    msg = seconds(data["message"], source, "message", allow_zero=True)
    act = data.get("activation")
    act = None if act is None else size_bytes(act, source, "activation")
    act_w = data.get("activation_w")
    if act_w is not None:
        if act is None:
            raise SpecError(f"{source}: field 'activation_w' needs 'activation' (the bytes it is a part of); add "
                            f"'activation:' or drop 'activation_w:'")
        act_w = size_bytes(act_w, source, "activation_w", allow_zero=True)
        if act_w > act:
            raise SpecError(f"{source}: field 'activation_w' ({act_w:g} bytes) must be at most 'activation' "
                            f"({act:g} bytes), the part of it W keeps; got {data['activation_w']!r}")
    blocking = data.get("blocking_sends", False)
    if not isinstance(blocking, bool):
        raise SpecError(f"{source}: field 'blocking_sends' must be true or false; got {blocking!r}")
    return StageTimes(tuple(f), tuple(b), tuple(w), msg, act, act_w, blocking, source)
