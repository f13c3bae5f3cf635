"""How a job splits and keeps each pipeline device's work: :class:`Parallel`, one checked record.

Every parallelism, precision and memory knob of a job is a field of this one record, and each
rule about a field alone is checked here, once: the command line (``--tp``, ``--zero``, ...),
the job (:class:`cost_models.job.Job`), the cost model (:class:`cost_models.transformer.TransformerCostModel`),
the layout search (:class:`planner.layout.LayoutSpace` yields jobs with one), the sweep grid,
plan files and the executor's run all carry the same record. Rules that join a field with
another record (ZeRO needs data-parallel replicas; tensor parallelism acts on a model's formulas,
not on a measured profile) are the job's (:class:`cost_models.job.Job`).

A message names the command-line option of the field (``--micro-batch`` for ``micro_batch``),
so the command line reports it as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .device import PRECISIONS      # the GEMMs' number format: a device's peak_flops keys
from .fp8 import DEFAULT_RECIPE, check_recipe

RECOMPUTE = ("none", "selective", "full")    # activation recomputation of the transformer blocks
ZERO_STAGES = (0, 1, 2, 3)   # sharded over the replicas: 1 the optimizer state, 2 + gradients, 3 + weights (FSDP)
CP_COMMS = ("ring", "allgather")   # how context parallelism exchanges K/V: a ring of P2P steps, or one all-gather


def _whole(value, option: str, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{option} must be an integer >= {low}; got {value!r}")


def option_name(field_name: str) -> str:
    """The command-line option of a field (``micro_batch`` -> ``--micro-batch``)."""
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """The parallelism and memory knobs of a job.

    ``tp``: T GPUs per pipeline device that split every layer (tensor parallel, Megatron-style):
    a layout is T x D x R GPUs. ``sequence_parallel``: with T > 1, norms, dropout and the stage
    boundaries on 1/T of the sequence. ``tp_overlap``: with T > 1, the group's collectives hidden
    behind the layer's compute (simulated only). ``zero``: the state sharded over the data-parallel
    replicas: 1 the optimizer state (ZeRO-1), 2 also the gradients (ZeRO-2), 3 also the weights
    (ZeRO-3, FSDP). ``dp_shard``: with ZeRO, the replicas a shard group spans (HSDP: R / dp_shard
    groups replicate each other; 0: all R, plain FSDP). ``reshard_after_forward``: with ZeRO-3,
    weights are gathered again for each micro-batch's F and B (torchtitan's
    ``reshard_after_forward=True``); without it they are gathered once per step and kept until its
    last backward (Llama 3, torchtitan under PP). ``cp``: C GPUs per pipeline device that split the
    sequence (context parallel; 2C chunks for causal load balance; T x C x D x R GPUs), exchanging
    K/V by ``cp_comm``: ``ring`` (C-1 P2P steps behind the attention compute) or ``allgather``
    (Llama 3's all-gather of K/V before the attention). ``recompute``: none | selective | full activation
    recomputation. ``micro_batch``: sequences (samples) per micro-batch; ``seq_len``: the
    training sequence length (None: the model's own, for both).

    Mixtures of experts (:mod:`cost_models.moe`): ``ep`` E GPUs split each MoE block's experts
    and ``etp`` split each expert (folded onto the stage's T x R GPUs); ``expert_imbalance`` the
    busiest EP rank's tokens over the mean (1: balanced); ``capacity_factor`` > 0 drops the tokens
    beyond that many times the mean (0: dropless); ``fp8_dispatch`` sends the dispatch in 1-byte
    elements; ``a2a_hierarchical`` runs the all-to-all as DeepEP does (once per remote node, then
    NVLink), with ``route_nodes`` M > 0 DeepSeek-V3's node-limited routing (at most M nodes per
    token). ``expert_load``: tokens routed to each expert (a measured histogram, in place of
    ``expert_imbalance``: the busiest rank's share follows from which experts each EP rank holds).
    ``overlap_fb``: an F and the B of another micro-batch placed back to back on a device
    run overlapped, each one's all-to-alls behind the other's compute (DualPipe's overlap), the
    communication kernels taking ``overlap_sm_share`` of the GPU (DeepSeek: 20 of 132 SMs).

    ``precision``: the GEMMs' format (None: the model's, bf16 for a 16-bit model where the device has
    it); fp8 runs the linear layers at the device's fp8 peak and the attention core in 16 bits
    (weights, gradients, optimizer state and activations are counted as in 16 bits, plus the fp8
    copies of the linear layers' weights; :mod:`cost_models.fp8`). ``fp8_recipe``: how fp8 casts
    are scaled (delayed | tensorwise | blockwise; None: delayed, Transformer Engine's default);
    ``fp8_gather``: ZeRO-3's weight all-gathers carry fp8 (1 byte per parameter)."""

    tp: int = 1
    sequence_parallel: bool = False
    tp_overlap: bool = False
    zero: int = 0
    dp_shard: int = 0
    reshard_after_forward: bool = False
    cp: int = 1
    cp_comm: str = "ring"
    recompute: str = "none"
    micro_batch: int | None = None
    seq_len: int | None = None
    ep: int = 1
    etp: int = 1
    expert_imbalance: float = 1.0
    capacity_factor: float = 0.0
    fp8_dispatch: bool = False
    a2a_hierarchical: bool = False
    route_nodes: int = 0
    overlap_fb: bool = False
    overlap_sm_share: float = 20 / 132
    precision: str | None = None
    fp8_recipe: str | None = None
    fp8_gather: bool = False
    expert_load: tuple[float, ...] | None = None

    def __post_init__(self):
        _whole(self.tp, "--tp")
        for name in ("sequence_parallel", "tp_overlap"):
            on = getattr(self, name)
            if not isinstance(on, bool):
                raise ValueError(f"{option_name(name)} is a switch (true or false); got {on!r}")
            if on and self.tp == 1:
                raise ValueError(f"{option_name(name)} acts on a tensor-parallel group; give --tp > 1")
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ValueError(f"--zero must be 0, 1, 2 or 3 (sharded over --dp: 1 the optimizer state, 2 and the "
                             f"gradients, 3 and the weights); got {self.zero!r}")
        _whole(self.dp_shard, "--dp-shard", 0)
        if self.dp_shard and not self.zero:
            raise ValueError("--dp-shard sets the replicas a ZeRO shard spans; give --zero 1, 2 or 3")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"--reshard-after-forward is a switch (true or false); got {self.reshard_after_forward!r}")
        if self.reshard_after_forward and self.zero != 3:
            raise ValueError("--reshard-after-forward frees the weights ZeRO-3 gathers; give --zero 3")
        _whole(self.cp, "--cp")
        if self.cp_comm not in CP_COMMS:
            raise ValueError(f"--cp-comm must be one of {', '.join(CP_COMMS)}; got {self.cp_comm!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--recompute must be one of {', '.join(RECOMPUTE)}; got {self.recompute!r}")
        for name in ("micro_batch", "seq_len"):
            if getattr(self, name) is not None:
                _whole(getattr(self, name), option_name(name))
        _whole(self.ep, "--ep")
        _whole(self.etp, "--etp")
        _whole(self.route_nodes, "--route-nodes", 0)
        for name in ("fp8_dispatch", "a2a_hierarchical", "overlap_fb"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{option_name(name)} is a switch (true or false); got {getattr(self, name)!r}")
        if self.route_nodes and not self.a2a_hierarchical:
            raise ValueError("--route-nodes limits the nodes of a hierarchical all-to-all; give --a2a-hierarchical")
        for name, low, what in (("expert_imbalance", 1.0, "a ratio >= 1 (the busiest expert rank's tokens / the "
                                 "mean; 1 balanced)"),
                                ("capacity_factor", 0.0, "0 (dropless) or a factor >= 1")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low:
                raise ValueError(f"{option_name(name)} must be {what}; got {v!r}")
        if 0 < self.capacity_factor < 1:
            raise ValueError(f"--capacity-factor must be 0 (dropless) or a factor >= 1; got {self.capacity_factor!r}")
        if self.expert_load is not None:
            load = self.expert_load
            if isinstance(load, (str, bytes)) or not hasattr(load, "__iter__"):
                raise ValueError(f"--expert-load must be tokens per expert (a list of numbers); got {load!r}")
            load = tuple(load)
            if not load or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                               or v < 0 for v in load) or not sum(load):
                raise ValueError("--expert-load must list tokens per expert: numbers >= 0, not all 0")
            if self.expert_imbalance != 1.0:
                raise ValueError("give --expert-imbalance or --expert-load, not both (the load sets the imbalance)")
            object.__setattr__(self, "expert_load", tuple(float(v) for v in load))
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.fp8_recipe is not None:
            check_recipe(self.fp8_recipe)
            if self.precision != "fp8":
                raise ValueError("--fp8-recipe sets how fp8 casts are scaled; give --precision fp8")
        if not isinstance(self.fp8_gather, bool):
            raise ValueError(f"--fp8-gather is a switch (true or false); got {self.fp8_gather!r}")
        if self.fp8_gather and (self.precision != "fp8" or self.zero != 3):
            raise ValueError("--fp8-gather all-gathers ZeRO-3's weights in fp8; give --precision fp8 and --zero 3")
        v = self.overlap_sm_share
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < 1):
            raise ValueError(f"--overlap-sm-share must be a share of the GPU in [0, 1); got {v!r}")

    @property
    def recipe(self) -> str | None:
        """The fp8 scaling recipe in force (None: not fp8; :data:`cost_models.fp8.FP8_RECIPES`)."""
        return (self.fp8_recipe or DEFAULT_RECIPE) if self.precision == "fp8" else None

    def sized(self, model):
        """``model`` (a :class:`cost_models.model_spec.ModelSpec`) at this record's micro-batch and
        sequence length where they are given (the one place a job's sizes reach a model)."""
        changes = {k: v for k, v in (("micro_batch", self.micro_batch), ("seq_len", self.seq_len))
                   if v is not None and getattr(model, k) != v}
        return model.replace(**changes) if changes else model

    def changed(self) -> list[str]:
        """The fields whose value is not the default, in field order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]

    def given(self) -> list[str]:
        """The options whose value is not the default, in field order (for messages)."""
        return [option_name(f) for f in self.changed()]

    def record(self) -> dict:
        """The record as plain data (JSON)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_record(cls, data: dict, where: str = "parallel") -> "Parallel":
        """The record read back from :meth:`record`'s data; an unknown field is one line naming it."""
        known = {f.name for f in fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise ValueError(f"{where}: unknown field {extra[0]!r} (fields: {', '.join(sorted(known))})")
        return cls(**data)
