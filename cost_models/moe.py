"""Mixture-of-experts blocks under expert parallelism: parameters, FLOPs, activations and the
expert all-to-all, per GPU.

A MoE block is a llama block whose MLP is a router (a gate GEMM h x E, softmax or sigmoid scores,
top-k; sigmoid carries DeepSeek's per-expert bias, E parameters), E routed experts (each a SwiGLU
of width f_e: 3 h f_e parameters), optionally shared experts every token passes (a SwiGLU of width
f_s; Qwen2-MoE gates it with a sigmoid, h parameters) (:class:`cost_models.model_spec.ModelSpec`).

Expert parallelism folds the GPUs of a pipeline stage, as Megatron-LM does ("parallel folding"):
the attention runs on T (tensor) x C (context) x R (data) GPUs, the experts on ETP x EP x EDP =
T x C x R GPUs of the same stage (Megatron-LM's ``initialize_model_parallel``,
megatron/core/parallel_state.py: the expert ``RankGenerator`` has cp=1 and EDP = world / (ETP EP
PP), so its data-parallel axis is the attention's C x R; the same order 'tp-cp-ep-dp-pp', ETP
innermost). Routing is per token: with C > 1 each GPU routes its s/C tokens of the sequence (n
below is then b s / (t C)). Rules (:func:`check_expert_parallel`): EP x ETP divides T x C x R, EP
divides E, ETP divides f_e; with T > 1 sequence parallelism is on (Megatron-LM requires it with MoE).

Per GPU and micro-batch (b sequences of s tokens, t = T; n = bs / t tokens a GPU owns)::

    routed experts held      E / EP experts, each 3 h f_e / ETP parameters
    expert FLOPs (forward)   2 n k 3 h f_e x imbalance          (independent of EP and ETP: the
                             T x R GPUs share the stage's n k T R token-expert pairs; the slowest
                             GPU gets ``imbalance`` x the mean; a capacity factor c caps it at c)
    router, shared (fwd)     2 n (E h) + 2 n (3 h f_s) / 1      (the router and shared expert on
                             the GPU's own tokens)
    dispatch bytes sent      n k h d_dispatch x imbalance       (k copies of each token; 1 byte
                             with fp8 dispatch, else the model's d)
    combine bytes            n k h d x imbalance                (always 16-bit)

The backward has the same GEMM FLOPs again for the inputs and again for the weights, and the same
two all-to-alls (the combine's gradient is a dispatch and the other way round).

The all-to-all of an EP group (:class:`ExpertGroup`): the group's GPUs are EP consecutive
members at stride ETP of the stage's T x R GPUs (Megatron's order: ETP innermost), so they span
m = ceil(EP ETP / G) nodes of G GPUs, g = EP / m on each. A GPU sends a fraction (g - 1) / EP of
its bytes over NVLink and (EP - g) / EP through its node's NICs (each GPU's share of them: the
node's NIC bandwidth / G); the two run at once, so the time is the larger plus a latency.
Hierarchical (DeepEP-style, ``a2a_hierarchical``): a token crosses the fabric once per remote node
holding one of its experts (then fans out on NVLink), E[distinct nodes] = m (1 - (1 - 1/m)^k),
capped by node-limited routing (``route_nodes`` M: DeepSeek-V3's at most 4 nodes per token); the
remote share is (m - 1) / m of them.

Memory: the routed experts' weights, gradients and optimizer state on a GPU are E / EP x 1 / ETP
of the block's; with ZeRO-1 their optimizer state is sharded over EDP = T C R / (EP ETP) (the dense
part's over R). The expert gradients are all-reduced over EDP, separately from the dense ones'
(charged at the step's end: :meth:`cost_models.transformer.TransformerCostModel.layer_costs`).
Activations kept per token: the router's fp32 scores (4 E bytes) and its routing (the k int64
expert indices, 8 k; per kept copy its int64 pair and token index and its gate weight, 16 + d:
:func:`routing_bytes`; with EP > 1 two int64 orders per received pair to regroup them by local
expert, :func:`regroup_bytes`), and for each of the k copies its dispatched input and combined output
(2 h d) and the SwiGLU's gate, up and product (3 f_e d), times the imbalance; with ETP > 1 the
experts' input is the ETP group's rows all-gathered after the dispatch (Megatron-LM's order; the
first linear keeps it: ETP h d per copy instead of h d), each GPU's gate, up and product 1/ETP of
the width on ETP times the rows (3 f_e d per copy again), the output reduce-scattered back (h d); the
shared expert's gate, up and product (3 f_s d / t), with Qwen2-MoE's gate also its output and the gate (h + 1) d.
Dispatch buffers: one send and one receive buffer of the dispatched tokens (the transient bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .cluster import Cluster
from .files import FileError, read_text
from .model_spec import ModelSpec
from .parallel import Parallel, option_name

SWIGLU = 3          # matrices of a SwiGLU expert (gate, up, down)
SCORE_BYTES = 4     # the router keeps fp32 scores
INDEX_BYTES = 8     # routing indices are int64


def router_params(spec: ModelSpec) -> int:
    """The gate (h x E) and, with sigmoid scores, DeepSeek's per-expert bias (E)."""
    return spec.experts * spec.hidden + (spec.experts if spec.router == "sigmoid" else 0)


def expert_params(spec: ModelSpec) -> int:
    """One routed expert: 3 h f_e."""
    return SWIGLU * spec.hidden * spec.expert_width


def shared_params(spec: ModelSpec) -> int:
    """The shared expert(s): 3 h f_s, plus Qwen2-MoE's gate (h)."""
    return SWIGLU * spec.hidden * spec.shared_ffn + (spec.hidden if spec.shared_gate else 0)


def routing_bytes(spec: ModelSpec, tokens: float, pairs: float) -> float:
    """What a router keeps besides its scores, for ``tokens`` routed and ``pairs`` token-expert pairs
    kept: each token's k selected experts (int64), and per kept pair its index and its token's
    (int64, for the gather into expert order and the weighted sum back) and its gate weight (d):
    n k 8 + pairs (16 + d), as the executor's MoE MLP keeps them (:mod:`executor.moe`)."""
    return tokens * spec.top_k * INDEX_BYTES + pairs * (2 * INDEX_BYTES + spec.dtype_bytes)


def regroup_bytes(par: Parallel, pairs: float) -> float:
    """What an expert rank keeps to regroup the rows it computes (source-major as they arrive: from
    its EP peers, then gathered over its ETP group) by its local experts and back: two int64 orders
    per row (the gather into expert order and the one back into arrival order), ``16 ETP pairs``
    with EP x ETP > 1, none at EP = ETP = 1 (the rows arrive in expert order), as
    :class:`executor.moe.LocalExperts` keeps them."""
    return pairs * par.etp * 2 * INDEX_BYTES if par.ep * par.etp > 1 else 0.0


def shared_gate_bytes(spec: ModelSpec, tokens: float) -> float:
    """Qwen2-MoE's gated shared expert also keeps the shared output and the gate, n (h + 1) d."""
    return tokens * (spec.hidden + 1) * spec.dtype_bytes if spec.shared_ffn and spec.shared_gate else 0.0


def moe_mlp_params(spec: ModelSpec) -> int:
    """All parameters of one MoE block's MLP (router, routed and shared experts)."""
    return router_params(spec) + spec.experts * expert_params(spec) + shared_params(spec)


def moe_mlp_active_params(spec: ModelSpec) -> int:
    """The parameters one token passes through: router, k routed experts, shared experts."""
    return router_params(spec) + spec.top_k * expert_params(spec) + shared_params(spec)


# the Parallel fields that act on a mixture of experts only
MOE_KNOBS = ("ep", "etp", "expert_imbalance", "expert_load", "capacity_factor", "fp8_dispatch", "a2a_hierarchical",
             "route_nodes", "overlap_fb", "overlap_sm_share")


def moe_knobs_given(par: Parallel) -> list[str]:
    """The MoE options of ``par`` that differ from their defaults (as command-line options)."""
    return [option_name(f) for f in par.changed() if f in MOE_KNOBS]


def check_expert_parallel(spec: ModelSpec, par: Parallel, replicas: int) -> None:
    """The rules that join the MoE knobs with the model and the layout (module docstring), one
    line naming the option to change."""
    given = moe_knobs_given(par)
    if not spec.is_moe:
        if given:
            raise ValueError(f"{given[0]} acts on a mixture of experts; model {spec.name} is dense "
                             f"(e.g. --model mixtral-8x7b)")
        return
    if par.tp > 1 and not par.sequence_parallel:
        raise ValueError(f"a mixture of experts at --tp {par.tp} needs --sequence-parallel (Megatron-LM requires it: "
                         f"each GPU routes its 1/T of the tokens)")
    fold = par.tp * par.cp * replicas
    if fold % (par.ep * par.etp):
        shape = f"T x C x R = {par.tp} x {par.cp} x {replicas}" if par.cp > 1 else f"T x R = {par.tp} x {replicas}"
        raise ValueError(f"--ep {par.ep} x --etp {par.etp} must divide the stage's {shape} GPUs "
                         f"the experts fold onto; pick --ep/--etp that divide {fold}, or more --dp")
    if spec.experts % par.ep:
        raise ValueError(f"--ep {par.ep} does not divide the {spec.experts} experts of {spec.name}; pick a divisor")
    if spec.expert_width % par.etp:
        raise ValueError(f"--etp {par.etp} does not divide the expert width {spec.expert_width} of {spec.name}; "
                         f"pick a divisor")
    if par.expert_load is not None and len(par.expert_load) != spec.experts:
        raise ValueError(f"--expert-load lists {len(par.expert_load)} experts; {spec.name} has {spec.experts} per "
                         f"block")
    if par.route_nodes and par.route_nodes > spec.top_k:
        raise ValueError(f"--route-nodes {par.route_nodes} exceeds the {spec.top_k} experts a token goes to; "
                         f"give at most {spec.top_k}")


def expert_data_parallel(par: Parallel, replicas: int) -> int:
    """EDP: the GPUs holding the same experts (T x C x R / (EP x ETP)), which all-reduce their gradients."""
    return par.tp * par.cp * replicas // (par.ep * par.etp)


def effective_imbalance(spec: ModelSpec, par: Parallel) -> float:
    """Token-expert pairs on the busiest EP rank / the mean. From ``expert_load`` (tokens per
    expert; rank r holds experts r E/EP .. (r+1) E/EP - 1, Megatron's contiguous split): with a
    capacity factor c each expert keeps at most c x the mean per expert (the rest dropped), then
    the busiest rank's sum over the mean rank's. Else ``expert_imbalance``, capped at c."""
    c = par.capacity_factor
    if par.expert_load is None:
        return min(par.expert_imbalance, c) if c else par.expert_imbalance
    load = par.expert_load
    mean = sum(load) / len(load)
    kept = [min(x, c * mean) for x in load] if c else list(load)
    per = len(load) // par.ep
    ranks = [sum(kept[r * per:(r + 1) * per]) for r in range(par.ep)]
    return max(ranks) / (sum(load) / par.ep)


def read_expert_load(path) -> tuple[float, ...]:
    """Tokens per expert from a file: numbers separated by commas, spaces or new lines (a JSON
    list reads the same); one line naming the file and the first bad entry otherwise."""
    text = read_text(path, "expert load file")
    items = [t for t in text.replace("[", " ").replace("]", " ").replace(",", " ").split() if t]
    out = []
    for t in items:
        try:
            v = float(t)
        except ValueError:
            raise FileError(f"{path}: {t!r} is not a number; list tokens per expert, e.g. 812, 640, 1033") from None
        if not math.isfinite(v) or v < 0:
            raise FileError(f"{path}: {t!r} is not a token count >= 0")
        out.append(v)
    if not out or not sum(out):
        raise FileError(f"{path}: no tokens; list tokens per expert, e.g. 812, 640, 1033")
    return tuple(out)


def write_expert_load(path, load) -> None:
    """Tokens per expert to ``path`` in the form :func:`read_expert_load` reads (one line, comma
    separated), e.g. a run's recorded load (:func:`executor.moe.run_expert_load`)."""
    from pathlib import Path
    Path(path).write_text(", ".join(str(int(x)) if float(x).is_integer() else repr(float(x)) for x in load) + "\n")


@dataclass(frozen=True)
class MoeShare:
    """One GPU's share of a MoE block's MLP for one micro-batch (see the module docstring).

    flops_router / flops_shared / flops_expert: forward FLOPs of the router, the shared expert
    and the routed experts (the input and weight gradients repeat each). params_dense /
    params_expert: the parameters held. act: bytes kept from F to B. dispatch_bytes /
    combine_bytes: bytes the GPU sends in each all-to-all."""

    flops_router: float
    flops_shared: float
    flops_expert: float
    params_dense: int
    params_expert: int
    act: float
    dispatch_bytes: float
    combine_bytes: float

    @property
    def flops_dense(self) -> float:
        """Forward FLOPs of the router and the shared expert (on the GPU's own tokens)."""
        return self.flops_router + self.flops_shared


def moe_share(spec: ModelSpec, par: Parallel) -> MoeShare:
    """A GPU's share of one MoE block's MLP (``spec`` at the job's micro-batch and sequence)."""
    t = par.tp
    n = spec.micro_batch * spec.seq_len / t
    imb = effective_imbalance(spec, par)
    h, k, fe, d = spec.hidden, spec.top_k, spec.expert_width, spec.dtype_bytes
    pairs = n * k * imb                                  # token-expert pairs the GPU computes
    flops_expert = 2.0 * pairs * SWIGLU * h * fe
    flops_router, flops_shared = 2.0 * n * spec.experts * h, 2.0 * n * shared_params(spec)
    params_expert = spec.experts // par.ep * expert_params(spec) // par.etp
    params_dense = router_params(spec) + shared_params(spec) // t
    act = n * SCORE_BYTES * spec.experts + routing_bytes(spec, n, pairs) + regroup_bytes(par, pairs) + \
        pairs * ((1 + par.etp) * h + SWIGLU * fe) * d + \
        n * SWIGLU * spec.shared_ffn * d + shared_gate_bytes(spec, n)
    dispatch = pairs * h * (1 if par.fp8_dispatch else d)
    return MoeShare(flops_router, flops_shared, flops_expert, params_dense, params_expert, float(act), float(dispatch),
                    float(pairs * h * d))


@dataclass(frozen=True)
class ExpertGroup:
    """The links of one expert-parallel group on ``cluster`` (unplaced: the stage's GPUs are
    consecutive devices, the group's EP members at stride ETP among them), and how its all-to-all
    runs (module docstring)."""

    cluster: Cluster
    ep: int
    etp: int = 1
    hierarchical: bool = False
    route_nodes: int = 0          # node-limited routing: at most M nodes per token (0: any)
    top_k: int = 1

    @property
    def nodes(self) -> int:
        """Nodes the group spans."""
        return max(1, math.ceil(self.ep * self.etp / self.cluster.devices_per_node))

    @property
    def per_node(self) -> int:
        """Members of the group on one node."""
        return max(1, self.ep // self.nodes)

    def remote_copies(self) -> float:
        """Copies of one token's k that cross the fabric (as a fraction of k when flat)."""
        m, g, k = self.nodes, self.per_node, self.top_k
        if m == 1:
            return 0.0
        if not self.hierarchical:
            return k * (self.ep - g) / self.ep
        distinct = m * (1.0 - (1.0 - 1.0 / m) ** k)
        if self.route_nodes:
            distinct = min(distinct, float(self.route_nodes))
        return distinct * (m - 1) / m

    def time(self, nbytes: float) -> float:
        """Seconds of one all-to-all in which every member sends ``nbytes`` (k copies of its
        tokens, spread evenly over the group's experts)."""
        if self.ep <= 1 or nbytes <= 0:
            return 0.0
        c = self.cluster
        intra_frac = (self.per_node - 1) / self.ep
        t_intra = nbytes * intra_frac / c.intra.bandwidth + (c.intra.latency if self.per_node > 1 else 0.0)
        if self.nodes == 1:
            return t_intra
        per_gpu_nic = c.inter.bandwidth * c.nics_per_node / c.devices_per_node
        inter = nbytes / self.top_k * self.remote_copies()
        t_inter = inter / per_gpu_nic + c.inter.latency
        if self.hierarchical:       # the remote copies fan out on NVLink at the far end as well
            t_intra += inter / c.intra.bandwidth
        return max(t_intra, t_inter)
