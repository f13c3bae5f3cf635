"""The one table of the command line's options: :func:`table`, one :class:`Option` per row.

A row says which flags set it, which record field it fills (``"Layout.devices"``,
``"Parallel.tp"``, ``"Job.model"``, ``"ClusterChoice.nodes"``, ``"Faults.jitter"``,
``"RunConfig.steps"``; None: the command reads it itself), its checked type
(:mod:`experiments.checks`: a bad value is refused while parsing), its choices (the library's
constants) and its help. :data:`COMMANDS` says which rows each command takes and in which grammar:

* ``scalar`` -- one value (simulate, compare, run, validate, calibrate; ``--tp 2``);
* ``list`` -- a comma-separated list, each value checked as the scalar is (sweep's axes: ``--tp 1,2``);
* ``auto`` -- ``auto`` (the search chooses) or such a list (plan's search axes: ``--tp auto``,
  ``--tp 2,4``).

:func:`add_options` generates a command's parser from its entry; :func:`fields_of` reads the parsed
values of one record back through the table (:func:`experiments.jobs.job_from_args`). Adding a knob
is one row here (and its field in its record): every command that lists the row takes it, in its
grammar, with the same name, type and help.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable

from cost_models import FABRICS, MAPPINGS
from cost_models.frameworks import TARGETS
from cost_models.job import DEFAULT_CLUSTER, DEFAULT_MODEL
from cost_models.fp8 import FP8_RECIPES
from cost_models.kernels import COST_MODELS, GRAD_ACCUMULATION
from cost_models.moe import MOE_KNOBS
from cost_models.parallel import CP_COMMS, PRECISIONS, RECOMPUTE, ZERO_STAGES
from cost_models.profile import BUSY_CORES
from schedules import families, names
from executor.choices import DEVICES, DTYPES, OPTIMIZERS, RUNTIMES
from schedules.registry import ALIASES

from .checks import (bandwidth, byte_size, chrome_file, csv_file, expert_load_file, factor_pair, figure_file, float_in,
                     input_file, int_in, memory_limit, nonneg_float, nonneg_int, output_as, output_dir,
                     output_file, positive_float, positive_int, token_count)

SCALAR, LIST, AUTO = "scalar", "list", "auto"
GRAMMARS = (SCALAR, LIST, AUTO)
AUTO_VALUE = "auto"     # an auto-or-list option given as 'auto' (None: not given; both: the search chooses)
PLAN_SEARCHES = ("layout", "dapple")
DEFAULT_POLICIES = "fresh-first,append-first,scatter-first"


@dataclass(frozen=True)
class Option:
    """One row: ``flags`` (the first is the name), ``field`` (``Record.name`` it fills, None: the
    command's own), ``type`` (a checked argparse type), ``choices`` (each value one of them),
    ``help``, ``metavar``, ``default``, ``action`` (``store_true`` / ``append``, or ``(nargs, const)``
    for a flag whose value is optional), ``dest`` (default:
    the flag's name), ``invert`` (a ``--no-x`` flag filling ``x`` with its negation)."""

    flags: tuple[str, ...]
    field: str | None
    help: str
    type: Callable | None = None
    choices: tuple | None = None
    metavar: str | None = None
    default: Any = None
    action: str | None = None
    dest: str | None = None
    invert: bool = False

    @property
    def name(self) -> str:
        return self.dest or self.flags[0].lstrip("-").replace("-", "_")

    @property
    def record(self) -> str | None:
        return None if self.field is None else self.field.split(".")[0]

    @property
    def attr(self) -> str | None:
        return None if self.field is None else self.field.split(".")[1]

    def scalar(self, text: str):
        """One value of this row, checked (its type, then its choices)."""
        v = self.type(text) if self.type is not None else text
        if self.choices is not None and v not in self.choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(map(str, self.choices))}; got {text!r}")
        return v


def _chunked() -> str:
    return ", ".join(n for n, f in families().items() if f.takes_chunks)


def _rows() -> dict[str, Option]:
    """The table (built on first use: the help names the registry's schedules)."""
    O = Option  # noqa: N806
    rows = [
        # ---- Layout: the schedule and the pipeline
        ("schedule", O(("--schedule", "-s"), "Layout.schedule",
                       f"one of: {', '.join(names())} (or an upstream name: "
                       f"{', '.join(f'{a} = {n}' for a, n in ALIASES.items())})")),
        ("schedules", O(("--schedules", "-s"), None, "comma-separated schedule names, or 'all'", default="all",
                        dest="schedules")),
        ("schedule_file", O(("--schedule-file",), "Layout.schedule_file",
                            "a schedule written as a file: torch.distributed.pipelining's CSV (FILE.csv, compute "
                            "actions 0F1 1I0 1W0 1B0) or pipetwin's text form (one line 'd: F0.s0 B0.s0 ...' per "
                            "device; 'pipetwin schedules --export' writes both); it fixes D and N and is checked for "
                            "deadlocks before anything runs", type=input_file, metavar="FILE")),
        ("devices", O(("--devices", "-D"), "Layout.devices", "pipeline devices D", type=positive_int)),
        ("microbatches", O(("--microbatches", "-N"), "Layout.microbatches", "micro-batches N per iteration",
                           type=positive_int)),
        ("chunks", O(("--chunks", "-v"), "Layout.chunks",
                     f"chunks per device for the schedules that take them ({_chunked()}; default 2)",
                     type=positive_int)),
        ("variant", O(("--variant",), "Layout.variant", "a schedule's variant (default: its first); " +
                      "; ".join(f"{n}: {', '.join(f.variants)}" for n, f in families().items() if f.variants))),
        ("dp", O(("--dp",), "Layout.replicas", "data-parallel replicas R of the whole pipeline (default 1)",
                 type=positive_int)),
        ("memory_limit", O(("--memory-limit",), "Layout.memory_limit",
                           "zb-auto: each device's limit, in Ma (activations of full stages, e.g. 12) or bytes of "
                           "device memory with a unit (e.g. '40 GiB'), in place of --variant's",
                           type=memory_limit, metavar="MA|BYTES")),
        ("no_eager", O(("--no-eager",), "Job.eager", "all-reduce gradients at the end, not in bubbles",
                       action="store_true", invert=True)),
        # ---- Parallel: the job's parallelism, precision and memory knobs
        ("tp", O(("--tp",), "Parallel.tp", "tensor-parallel size T: GPUs per pipeline device that split every "
                 "layer Megatron-style (T x D x R GPUs; default 1)", type=positive_int)),
        ("sequence_parallel", O(("--sequence-parallel",), "Parallel.sequence_parallel",
                                "with --tp: norms and dropouts on 1/T of the sequence, reduce-scatter + all-gather "
                                "in place of the tensor-parallel all-reduces (Korthikanti et al., Megatron's sequence "
                                "parallelism)", action="store_true")),
        ("tp_overlap", O(("--tp-overlap",), "Parallel.tp_overlap",
                         "with --tp: the tensor-parallel collectives overlap the layer's compute (default: on the "
                         "critical path, Megatron's default)", action="store_true")),
        ("zero", O(("--zero",), "Parallel.zero", "ZeRO stage, sharded over the --dp replicas: 1 the optimizer "
                   "state (reduce-scatter + all-gather in place of the gradient all-reduce), 2 and the gradients, "
                   "3 and the weights (FSDP: all-gathered for the compute; default 0)",
                   type=int, choices=tuple(ZERO_STAGES))),
        ("dp_shard", O(("--dp-shard",), "Parallel.dp_shard", "with --zero: the replicas one shard group spans "
                       "(HSDP: --dp / this many groups replicate each other; default 0: all of --dp)",
                       type=nonneg_int, metavar="S")),
        ("reshard_after_forward", O(("--reshard-after-forward",), "Parallel.reshard_after_forward",
                                    "with --zero 3: gather the weights again for every micro-batch's forward and "
                                    "backward (default: gathered once per step and kept until its last backward, as "
                                    "Llama 3 and torchtitan under pipelining do)", action="store_true")),
        ("cp", O(("--cp",), "Parallel.cp", "context-parallel size C: GPUs per pipeline device that split the "
                 "sequence (2C chunks, causally balanced; T x C x D x R GPUs; default 1)", type=positive_int)),
        ("cp_comm", O(("--cp-comm",), "Parallel.cp_comm", "with --cp: how K/V are exchanged: ring (C-1 P2P steps "
                      "behind the attention compute; default) or allgather (Llama 3's all-gather before attention)",
                      choices=tuple(CP_COMMS))),
        ("recompute", O(("--recompute",), "Parallel.recompute",
                        "activation recomputation (default none): none keeps every activation; selective re-runs "
                        "the attention core in the backward (keeps no score matrix); full keeps only each block's "
                        "input and re-runs its forward", choices=tuple(RECOMPUTE))),
        ("micro_batch", O(("--micro-batch",), "Parallel.micro_batch",
                          "samples per micro-batch (default: the model spec's micro_batch, a model file's 4)",
                          type=positive_int)),
        ("seq_len", O(("--seq-len",), "Parallel.seq_len", "training sequence length (default: the model's; a "
                      "Hugging Face config's max_position_embeddings)", type=positive_int, metavar="S")),
        ("precision", O(("--precision",), "Parallel.precision",
                        "the GEMMs' number format (default: the model's, bf16 for 16-bit models); fp8 runs the "
                        "linear layers at the device's fp8 peak, the attention core in 16 bits",
                        choices=tuple(PRECISIONS))),
        ("fp8_recipe", O(("--fp8-recipe",), "Parallel.fp8_recipe",
                         "with --precision fp8: how the casts are scaled, as Transformer Engine's recipes: delayed "
                         "(per-tensor scale from the amax history; default), tensorwise (per-tensor scale from "
                         "the tensor: two reads per cast), blockwise (DeepSeek-V3's 1x128 / 128x128 block scales)",
                         choices=tuple(FP8_RECIPES))),
        ("p2p_scatter_gather", O(("--p2p-scatter-gather",), "Parallel.p2p_scatter_gather",
                                 "with --tp > 1: Megatron-LM's scatter-gather of the messages between stages (its "
                                 "2021 default): each of the T GPUs sends 1/T, the receiver all-gathers them over "
                                 "its TP group before the stage runs", action="store_true")),
        ("grad_accumulation", O(("--grad-accumulation",), "Job.grad_accumulation",
                                "kernel cost model, gpt blocks: how weight gradients add up over micro-batches, "
                                "fused (Megatron-LM's gradient-accumulation fusion into fp32 main gradients; "
                                "default) or autograd (its code before 2022: each micro-batch's 16-bit gradients "
                                "added into .grad)", choices=tuple(GRAD_ACCUMULATION))),
        ("fp8_gather", O(("--fp8-gather",), "Parallel.fp8_gather",
                         "with --precision fp8 and --zero 3: the weight all-gathers carry fp8 (1 byte per "
                         "parameter)", action="store_true")),
        # ---- Parallel: mixtures of experts (cost_models.moe)
        ("ep", O(("--ep",), "Parallel.ep", "expert-parallel size E: GPUs that split each MoE block's experts, folded "
                 "onto the stage's T x R GPUs as Megatron-LM does (E x ETP divides T x R; default 1)",
                 type=positive_int)),
        ("etp", O(("--etp",), "Parallel.etp", "expert tensor-parallel size: GPUs that split each expert (default 1)",
                  type=positive_int)),
        ("expert_imbalance", O(("--expert-imbalance",), "Parallel.expert_imbalance",
                               "tokens on the busiest expert-parallel rank / the mean (default 1: balanced); it "
                               "sets the pace of the experts' GEMMs and all-to-alls", type=float_in(1.0, 1e6),
                               metavar="RATIO")),
        ("expert_load", O(("--expert-load",), "Parallel.expert_load",
                          "a file of tokens routed to each expert (numbers separated by commas or spaces: a measured "
                          "histogram), in place of --expert-imbalance: each EP rank's load is that of the experts it "
                          "holds", type=expert_load_file, metavar="FILE")),
        ("capacity_factor", O(("--capacity-factor",), "Parallel.capacity_factor",
                              "drop the tokens beyond this many times an expert rank's mean (default 0: dropless)",
                              type=nonneg_float, metavar="C")),
        ("fp8_dispatch", O(("--fp8-dispatch",), "Parallel.fp8_dispatch",
                           "the all-to-all dispatch in 1-byte fp8 (the combine stays 16-bit)", action="store_true")),
        ("a2a_hierarchical", O(("--a2a-hierarchical",), "Parallel.a2a_hierarchical",
                               "the expert all-to-all as DeepEP runs it: a token crosses the fabric once per remote "
                               "node holding one of its experts, then fans out on NVLink", action="store_true")),
        ("route_nodes", O(("--route-nodes",), "Parallel.route_nodes",
                          "with --a2a-hierarchical: node-limited routing, each token to experts on at most M nodes "
                          "(DeepSeek-V3: 4; default 0: any)", type=nonneg_int, metavar="M")),
        ("overlap_fb", O(("--overlap-fb",), "Parallel.overlap_fb",
                         "an F and the B of another micro-batch placed back to back on a device run overlapped, "
                         "each one's expert all-to-alls behind the other's compute (DualPipe's overlap; dualpipe-v "
                         "places such pairs, any other schedule pairs an F with the B right after it)",
                         action="store_true")),
        ("overlap_sm_share", O(("--overlap-sm-share",), "Parallel.overlap_sm_share",
                               "with --overlap-fb: the share of the GPU the communication kernels take while they "
                               "run (default 20/132, DeepSeek's 20 of 132 SMs)", type=float_in(0.0, 0.99),
                               metavar="SHARE")),
        # ---- Job: the model, the cluster and where the costs come from
        ("model", O(("--model", "-m"), "Job.model",
                    "model preset, YAML file or Hugging Face config.json (Llama, Mistral, Qwen2/3, Mixtral, "
                    "Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-2; 'pipetwin presets' lists them), a per-layer "
                    "profile in PipeDream's graph format (FILE.txt, e.g. DAPPLE's profiles), or a model file "
                    "PATH.py:FUNC (executor/user_model.py) with its --profile")),
        ("cost_model", O(("--cost-model",), "Job.cost_model",
                         "layer times: 'kernels' (GEMM tiles and waves, memory-bound kernels, launch overhead: "
                         "costs depend on the micro-batch; default where the device has the constants) or 'linear' "
                         "(FLOPs at a fixed efficiency; the default for --model FILE.txt profiles, as DAPPLE scaled "
                         "them)", choices=tuple(COST_MODELS))),
        ("profile_batch", O(("--profile-batch",), "Job.profile_batch",
                            "the batch a --model FILE.txt profile was measured at (default: the pbs-B in its name)",
                            type=positive_int, metavar="B")),
        ("cluster", O(("--cluster", "-c"), "ClusterChoice.name",
                      f"cluster preset or YAML file, optionally sized NAME:NODES (default {DEFAULT_CLUSTER}; e.g. "
                      f"dgx-h100-ib:128; 'pipetwin presets' lists them); with --profile: the measured layer times "
                      f"scaled onto it (default there: this machine, as calibrated)")),
        ("nodes", O(("--nodes",), "ClusterChoice.nodes",
                    "number of nodes of the cluster's kind (overrides the preset's)", type=positive_int)),
        ("fabric", O(("--fabric",), "ClusterChoice.fabric",
                     "inter-node fabric: flat (one non-blocking switch), fat-tree (leaves of --nodes-per-leaf nodes) "
                     "or rail (rail-optimised: NIC k of a group on one switch)", choices=tuple(FABRICS))),
        ("oversubscription", O(("--oversubscription",), "ClusterChoice.oversubscription",
                               "fat-tree / rail: a leaf's down / up bandwidth (1 = non-blocking, e.g. 2)",
                               type=float_in(1.0, 1e6), metavar="RATIO")),
        ("nodes_per_leaf", O(("--nodes-per-leaf",), "ClusterChoice.nodes_per_leaf",
                             "fat-tree / rail: nodes under one leaf (rail) switch", type=positive_int)),
        ("unit_costs", O(("--unit-costs",), "Job.unit_costs",
                         "closed-form unit costs: F=1, B=2 per full stage, no communication, memory in Ma",
                         action="store_true")),
        ("profile", O(("--profile",), "Job.profile", "a calibration profile (pipetwin calibrate): measured costs "
                      "and network instead of --model/--cluster formulas", metavar="FILE.yaml")),
        ("stage_costs", O(("--stage-costs",), "Job.stage_costs",
                          "your own per-stage times (f, b, w seconds per stage, message seconds, optional activation "
                          "bytes; see the README): instead of --model/--cluster formulas",
                          type=input_file, metavar="FILE.yaml")),
        ("partition", O(("--partition",), "Job.partition",
                        "layers per stage of a model copy, e.g. 3,2,2,3 (a transformer's embedding and head count as "
                        "layers), or 'time': balanced by the profile's measured layer times (default: the "
                        "executor's split)", metavar="COUNTS|time")),
        ("device_map", O(("--device-map",), "Job.device_map",
                         "how ranks are placed on the cluster's devices (copies-same-node: BitPipe's mapping; "
                         "megatron: TP, then DP, then PP; sequential: rank order; by-pool: the stages spread over "
                         "a mixed cluster's pools in order, each stage's replicas on one pool; default megatron with "
                         "--tp > 1, else sequential; run --cluster MIXED: by-pool)", choices=tuple(sorted(MAPPINGS)))),
        ("memory_reserve", O(("--memory-reserve",), "Job.memory_reserve",
                             "device memory kept back for the CUDA context, communicator buffers and fragmentation, "
                             "e.g. '4 GiB' (default 1 GiB + 5%% of the device's memory)",
                             type=byte_size("--memory-reserve"), metavar="BYTES")),
        ("plan", O(("--plan",), "Job.plan", "a plan written by 'pipetwin plan --out' (it fixes the layout, model "
                   "and cluster: the options that would change them are refused)", metavar="PLAN.json")),
        # ---- another framework's job, in and out (cost_models.frameworks: one table for both ways)
        ("from_megatron", O(("--from-megatron",), None,
                            "the job of a Megatron-LM launch: its arguments as written on a command line (one or many "
                            "lines, '\\' continuations, a torchrun prefix and environment assignments) or a YAML "
                            "mapping of '--flag: value' (a functional test's MODEL_ARGS, with the recipe's nodes and "
                            "gpus); the options given override the file's (flags that change the cost but are not "
                            "modelled, and flags no row reads, are listed)", type=input_file, metavar="FILE")),
        ("from_torchtitan", O(("--from-torchtitan",), None,
                              "the job of torchtitan '--section.field value' overrides (parallelism, training, "
                              "activation-checkpoint:MODE; NGPU= or torchrun for the GPUs); torchtitan's model is its "
                              "recipe's: give --model", type=input_file, metavar="FILE")),
        ("to", O(("--to",), None, "megatron: Megatron-LM's pretrain_gpt.py arguments (a .yaml --out: a MODEL_ARGS "
                 "block); torchtitan: its --section.field overrides (a schedule torch has no name for is written as "
                 "a CSV beside --out, pipeline_parallel_schedule_csv); torch-csv: the schedule as "
                 "torch.distributed.pipelining's CSV", choices=TARGETS)),
        ("emit", O(("--emit",), None, "after the plan, print its job for another framework (as 'pipetwin export "
                   "--to' writes it; torchtitan's CSV beside --out); without --schedules the search takes the "
                   "schedules that framework runs", choices=TARGETS)),
        # ---- Faults (simulated runs)
        ("slowdown", O(("--slowdown",), "Faults.slowdown",
                       "a straggler: compute on RANK takes FACTOR times longer (repeatable)",
                       type=factor_pair("RANK", int), metavar="RANK=FACTOR", action="append", default=[])),
        ("slow_link", O(("--slow-link",), "Faults.slow_links",
                        "a slow link: divide the bandwidth of LINK (e.g. n1.nic0.out) by FACTOR (repeatable); the "
                        "run must cross it", type=factor_pair("LINK", str, "n1.nic0.out=4"), metavar="LINK=FACTOR",
                        action="append", default=[])),
        ("jitter", O(("--jitter",), "Faults.jitter", "relative std-dev of per-op compute noise",
                     type=nonneg_float, default=0.0)),
        ("seed", O(("--seed",), "Faults.seed", "seed for --jitter", type=nonneg_int, default=0)),
        ("a2a_wire", O(("--a2a-wire",), "Faults.a2a_wire",
                       "an emulated wire under the expert all-to-alls: each exchange of a MoE block's rows (dispatch, "
                       "combine, their gradients) ends no earlier than its bytes / BANDWIDTH after it starts (e.g. "
                       "'2 MB/s'); the simulator prices it so on a calibrated profile (--profile at --ep E > 1)",
                       type=bandwidth("--a2a-wire"), metavar="BANDWIDTH")),
        ("exact", O(("--exact",), "Job.exact",
                    "simulate every data-parallel replica op by op even when they are identical (by default one "
                    "replica stands for all when nothing tells them apart)", action="store_true")),
        # ---- RunConfig: the training options of an executor run
        ("run_seed", O(("--seed",), "RunConfig.seed", "seed of the weights and the synthetic data",
                       type=nonneg_int, default=0)),
        ("steps", O(("--steps",), "RunConfig.steps", "optimizer steps of a run (default {default})",
                    type=positive_int, default=3)),
        ("lr", O(("--lr",), "RunConfig.lr", "learning rate (default 1e-3)", type=positive_float, default=1e-3)),
        ("optimizer", O(("--optimizer",), "RunConfig.optimizer", "adam, or sgd with momentum 0.9",
                        choices=OPTIMIZERS, default="adam")),
        ("data", O(("--data",), "RunConfig.data", "train on the bytes of a text file (default: synthetic tokens)",
                   type=input_file, metavar="FILE")),
        ("device", O(("--device",), "RunConfig.device",
                     "auto: cuda:LOCAL_RANK + NCCL under torchrun when CUDA exists, else CPU + gloo",
                     choices=DEVICES, default="auto")),
        ("timeout", O(("--timeout",), "RunConfig.timeout", "seconds a receive or all-reduce may wait (default 60)",
                      type=positive_float, default=60.0)),
        ("recv_lookahead", O(("--recv-lookahead",), "RunConfig.recv_lookahead",
                             "receives posted ahead per peer, each holding a buffer (default 0 = all at step start)",
                             type=nonneg_int, default=0)),
        ("no_memory", O(("--no-memory",), "RunConfig.measure_memory", "do not measure activation memory",
                        action="store_true", invert=True)),
        ("dtype", O(("--dtype",), "RunConfig.dtype", "precision: bf16 is autocast mixed precision with fp32 master "
                    "weights and optimizer state; fp8 is bf16 with the linear layers in fp8 through torchao "
                    "(a GPU of compute capability 8.9 or newer, --tp 1)", choices=DTYPES, default="fp32")),
        ("inject_fault", O(("--inject-fault",), "RunConfig.fault",
                           "make RANK raise at the op TOKEN of its program (e.g. 1:F2.s1, 0:RG1.s0<1:2 in step 2) to "
                           "check that a failure ends the run; the token must be in that rank's program",
                           metavar="RANK:TOKEN[:STEP]")),
        # ---- the commands' own: what they print and write
        ("json", O(("--json",), None, "print one JSON object", action="store_true")),
        ("plot", O(("--plot",), None, "write the figure", type=figure_file, metavar="FILE.png")),
        ("all_replicas", O(("--all-replicas",), None, "--plot draws every data-parallel replica's ranks (default: "
                           "one replica, the one that ends last: replicas run the same program)",
                           action="store_true")),
        ("chrome_trace", O(("--chrome-trace",), None, "write a Chrome/Perfetto trace", type=chrome_file,
                           metavar="FILE.json")),
        ("trace", O(("--trace",), None, "write the trace as CSV", type=csv_file, metavar="FILE.csv")),
        ("out_dir", O(("--out",), None, "folder for the files written", type=output_dir, metavar="DIR",
                      dest="out")),
        ("out_file", O(("--out",), None, "the file written", type=output_file, dest="out")),
        ("no_progress", O(("--no-progress",), None, "no progress bar", action="store_true")),
        ("reference", O(("--reference",), None, "run the single-process reference instead", action="store_true")),
        ("check", O(("--check",), None, "also train the single-process reference (--reference) and compare the "
                    "losses step by step: exit status 1 at the first step that differs by more than 1e-5 relative "
                    "in fp32 (1e-3 in bf16), printing it and the difference", action="store_true")),
        ("runtime", O(("--runtime",), None,
                      "pipetwin: its executor trains; torch: torch.distributed.pipelining's _PipelineScheduleRuntime "
                      "trains from the schedule's torch CSV (a --schedule-file CSV as written, else the schedule's "
                      "export) beside pipetwin's executor, the losses side by side: exit status 1 where they differ "
                      "by more than 1e-5 relative (fp32)", choices=RUNTIMES, default="pipetwin")),
        ("calibration_profile", O(("--profile",), None, "a calibration profile (pipetwin calibrate)", type=input_file,
                                  metavar="FILE.yaml", dest="profile")),
        # ---- plan's own
        ("search", O(("--search",), None,
                     "layout: the whole-layout search (tensor-parallel T, pipeline D, data-parallel R, schedule "
                     "family, chunks, variant, micro-batch, recompute, ZeRO-1, sequence parallelism; the default for "
                     "transformer presets, YAML files and configs); dapple: DAPPLE's data x pipeline planner (stages, "
                     "partition, per-stage replicas, placement; T=1; the default for layer profiles FILE.txt, the "
                     "DAPPLE paper's models (bert, vgg-19, gnmt-16, amoebanet-36, xlnet-36), a --profile, and where "
                     "an option only it takes is given: --uniform, --policies, --no-simulate, --no-baselines, "
                     "--profile-batch)", choices=PLAN_SEARCHES)),
        ("global_batch", O(("--global-batch", "-G"), None, "samples (sequences) per iteration", type=positive_int)),
        ("global_tokens", O(("--global-tokens",), None, "the global batch in tokens per iteration instead of -G, e.g. "
                            "4M (k, M, G: powers of 1,024): a whole number of the model's sequences", type=token_count,
                            metavar="TOKENS")),
        ("gpus", O(("--gpus",), None, "the GPU budget: use at most N of the cluster's GPUs (the whole-layout search: "
                   "a multiple of the node size)", type=positive_int, metavar="N")),
        ("device_memory", O(("--memory-limit",), None, "memory per device, e.g. '16 GiB' (default: the device's "
                            "memory; above it only with --force)", metavar="BYTES", dest="memory_limit")),
        ("force", O(("--force",), None, "plan for a --memory-limit above the device's memory", action="store_true")),
        ("top", O(("--top",), None, "candidates re-simulated (default 6)", type=positive_int, default=6)),
        ("max_stages", O(("--max-stages",), None, "at most this many pipeline stages", type=positive_int)),
        ("uniform", O(("--uniform",), None, "DAPPLE search: only R x D plans (every stage on R devices)",
                      action="store_true")),
        ("policies", O(("--policies",), None, "DAPPLE search: placement policies to search (comma-separated)",
                       default=DEFAULT_POLICIES)),
        ("no_simulate", O(("--no-simulate",), None, "DAPPLE search: rank by the analytical model only",
                          action="store_true")),
        ("no_baselines", O(("--no-baselines",), None, "DAPPLE search: skip the PipeDream and data-parallel "
                           "baselines", action="store_true")),
        ("type_blind", O(("--type-blind",), None, "mixed cluster: keep (print first, write with --out) the type-blind "
                         "plan, today's planner as if every GPU were the first pool's kind (default split, devices "
                         "in order); the type-aware one and the gain are reported either way", action="store_true")),
        # ---- sweep's own
        ("workers", O(("--workers",), None, "local worker processes (default: all cores)", type=positive_int)),
        ("ray", O(("--ray",), None, "run the points on a Ray cluster (ADDRESS, e.g. 'auto'; alone: a local Ray); "
                  "needs pip install 'pipetwin[ray]'", metavar="ADDRESS", action=("?", "local"))),
        ("no_figures", O(("--no-figures",), None, "skip the figures", action="store_true")),
        # ---- validate's own (a sitting of runs)
        ("warmup", O(("--warmup",), None, "steps dropped at the start of every run (default 2)", type=nonneg_int,
                     default=2)),
        ("quiet_runs", O(("--repeats",), None, "quiet runs per schedule at least (default 3); the step time is the "
                         "median of the runs' noise-free times (each the median of its fast steps)",
                         type=int_in(1, 100), default=3, dest="repeats")),
        ("max_runs", O(("--max-runs",), None, "runs per schedule at most before the sitting is refused (default 12)",
                       type=int_in(1, 100), default=12)),
        ("max_spread", O(("--max-spread",), None, "largest run-to-run spread allowed: the step time with any one "
                         "run left out (default 0.05)", type=float_in(0.0, 10.0), default=0.05)),
        ("max_foreign", O(("--max-foreign",), None, f"cores' worth of other processes' CPU a run may see and still "
                          f"count (default {BUSY_CORES:g}); a sitting is refused as 'host busy' only where runs saw "
                          f"more", type=float_in(0.0, 10.0), default=BUSY_CORES)),
        ("max_drift", O(("--max-drift",), None, "with --profile: largest change of the host speed probe since "
                        "calibration (default 0.05)", type=float_in(0.0, 10.0), default=0.05)),
        ("report", O(("--report",), None, "write a dated markdown record of the sitting into DIR "
                     "(validate-YYYY-MM-DD-HHMM.md)", type=output_dir, metavar="DIR")),
        # ---- calibrate's own (measurements)
        ("ranks", O(("--ranks",), None, "ranks the predicted runs put on this host (default 2; with --tp T, each is "
                    "T processes)", type=positive_int, default=2)),
        ("timings", O(("--repeats",), None, "timings per measurement (median, >= 3)", type=positive_int, default=20,
                      dest="repeats")),
        ("runtime_steps", O(("--runtime-steps",), None, "steps of each traced run the runtime is fitted on (default "
                            "20; the first 2 are dropped)", type=int_in(3, 1000), default=20)),
        ("runtime_repeats", O(("--runtime-repeats",), None, "quiet traced runs per schedule at least, in interleaved "
                              "rounds (twice as many at most; default 3): the fit uses the noise-free steps of their "
                              "pooled steps", type=int_in(1, 100), default=3)),
    ]
    return dict(rows)


_TABLE: dict[str, Option] | None = None


def table() -> dict[str, Option]:
    """The rows by key (built once, on first use)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = _rows()
    return _TABLE


@dataclass(frozen=True)
class Use:
    """A command's use of a row: its ``grammar``, and where the command differs from the row: its
    ``default`` (``...``: the row's), ``required``, ``note`` (appended to the help: this command's
    default or reading), ``help`` (only for rows without a field: the command's own) or ``type``
    (a scalar's checked type: e.g. the format of the file ``--out`` writes)."""

    key: str
    grammar: str = SCALAR
    default: Any = ...
    required: bool = False
    note: str = ""
    help: str | None = None
    metavar: str | None = None
    extra_flags: tuple[str, ...] = field(default_factory=tuple)
    type: Callable | None = None    # this command's checked type in place of the row's (an output's format)


def use(key: str, grammar: str = SCALAR, **kw) -> Use:
    return Use(key, grammar, **kw)


_LAYOUT = ("schedule_file", "devices", "microbatches", "chunks", "variant", "dp", "tp", "memory_limit", "no_eager")
_COSTS = ("unit_costs", "model", "cost_model", "profile_batch", "cluster", "nodes", "fabric", "oversubscription",
          "nodes_per_leaf", "profile", "stage_costs", "partition", "device_map", "recompute", "sequence_parallel",
          "tp_overlap", "zero", "dp_shard", "reshard_after_forward", "cp", "cp_comm",
          "micro_batch", "memory_reserve", "seq_len", "precision", "fp8_recipe", "fp8_gather",
          "p2p_scatter_gather", "grad_accumulation", *MOE_KNOBS)
_NOTES = {"model": f"; default {DEFAULT_MODEL}"}
_FAULTS = ("slowdown", "slow_link", "jitter", "seed", "a2a_wire", "exact")
_IMPORTS = ("from_megatron", "from_torchtitan")
_PLAN_NOTE = ("; with --plan the plan brings it: the options that would change the plan's layout, model or "
              "cluster are refused, --tp-overlap, --fabric, --cost-model, --memory-reserve and the faults apply")
RUN_PLAN_HELP = "run a plan written by 'pipetwin plan --out' (instead of -s/-D/-N/--dp/--chunks/--model)"

def _costs() -> tuple[Use, ...]:
    return tuple(use(k, note=_NOTES.get(k, "")) for k in _COSTS)


# Which rows each command takes, in which grammar (the order is --help's).
COMMANDS: dict[str, tuple[Use, ...]] = {
    "simulate": (use("schedule"), *map(use, _LAYOUT), use("plan", note=_PLAN_NOTE), *_costs(),
                 *map(use, _IMPORTS), *map(use, _FAULTS), use("json"), use("plot", help="write the timeline figure"),
                 use("all_replicas"), use("chrome_trace"), use("trace")),
    "compare": (use("schedules"), *(use(k, note="; compared beside --schedules" if k == "schedule_file" else "")
                                 for k in _LAYOUT), *_costs(), *map(use, _IMPORTS), *map(use, _FAULTS), use("json"),
                use("plot", help="stacked timelines of all schedules"), use("all_replicas"),
                use("out_dir", help="also write table.csv, one Chrome trace per schedule and the figure here")),
    "run": (use("schedule"), *map(use, _LAYOUT), use("plan", help=None, note="; " + RUN_PLAN_HELP),
            use("model", note="; default tiny (no FILE.txt: the executor trains GPTs and model files)"),
            use("micro_batch"), use("partition", note="; 'time' reads --profile"),
            use("calibration_profile", help="calibration profile for --partition time"), use("steps"),
            use("run_seed"), use("lr"), use("optimizer"), use("data"),
            use("device"), use("timeout"), use("recv_lookahead"), use("no_memory"),
            use("slowdown", note="; the run sleeps (FACTOR - 1) x each F, B and W it measures on RANK"),
            use("a2a_wire", note="; the run sleeps it in each exchange's wait, from the exchange's start (an "
                                 "overlapped pair's other segment runs meanwhile)"),
            use("cluster", note="; a mixed cluster only: the stages spread over its pools in order (--device-map "
                                "by-pool), the slower pools' ranks slowed by the simulated ratio of their compute to "
                                "the fastest pool's (as --slowdown), the planner's typed split unless --partition"),
            use("dtype", note=" (default fp32)"),
            use("recompute", note="; a --plan brings its own"),
            use("device_map", note="; under torchrun: which (node, GPU) runs which rank (default the plan's map)"),
            use("sequence_parallel"), use("zero"), use("dp_shard"), use("reshard_after_forward"), use("seq_len"),
            use("cp"), use("cp_comm"), use("ep", note="; the executor: over the data-parallel replicas, T = 1"),
            use("etp"),
            use("capacity_factor", note=" (the executor's MoE MLP: each expert keeps ceil(C x tokens x k / experts) "
                "of a micro-batch's token-expert pairs, the highest-scored)"),
            use("overlap_fb", note=" (the executor runs each pair's F and B as interleaved segments, "
                                   "executor.overlap)"),
            use("runtime"), use("reference"), use("check"), use("json"), use("trace"),
            use("chrome_trace"),
            use("plot", help="write the timeline figure"), use("all_replicas"), use("inject_fault")),
    "sweep": (use("schedules"), use("devices", LIST, note=" (required, unless --from-megatron/--from-torchtitan gives "
                                                       "it)"),
              use("microbatches", LIST, note=" (required, unless a --from-* file gives it)"),
              use("dp", LIST, default=(1,)), use("tp", LIST, default=(1,)), use("micro_batch", LIST),
              use("chunks"), use("no_eager"),
              *(use(k, LIST, default=d) for k, d in (("zero", (0,)), ("recompute", ("none",)))),
              use("ep", LIST, default=(1,), note=" (a list: one point each)"),
              *(u for u in _costs() if u.key not in ("partition", "micro_batch", "zero", "recompute", "ep")),
              *map(use, _IMPORTS), use("exact"),
              use("out_dir", required=True, help="folder for sweep.csv, sweep.jsonl and the figures"),
              use("workers"), use("ray"), use("no_progress"), use("no_figures")),
    "plan": (use("search"),
             use("model", note="; also the DAPPLE paper's models vgg-19, gnmt-16, amoebanet-36, xlnet-36"),
             use("seq_len", note="; whole-layout search"), use("cost_model"), use("profile_batch"),
             use("cluster"), use("nodes"), use("fabric"), use("oversubscription"), use("nodes_per_leaf"),
             use("calibration_profile", help="a calibration profile (pipetwin calibrate --model ...): measured "
                 "per-layer costs (the DAPPLE search)"),
             use("schedules", default=None, note=" (default: dapple for the DAPPLE search; every family but "
                 "zb-auto for the whole layout)"),
             use("tp", AUTO, note=" (whole-layout search: auto = every divisor of the node size the model splits, "
                 "the default)"),
             use("devices", AUTO, note=" (whole-layout search: auto = every divisor, the default)"),
             use("cp", AUTO, note=" (whole-layout search: auto = 1 and every power of two C that leaves each GPU at "
                 "least 8,192 tokens, the default)"),
             use("cp_comm", note=" (whole-layout search: every candidate's with C > 1; default ring)"),
             use("micro_batch", AUTO, extra_flags=("--micro-batches",),
                 note=" (whole-layout search; auto = 1,2,4,8, the default)"),
             use("recompute", AUTO, note=" (whole-layout search: auto = all three, the default; the DAPPLE search "
                 "takes one, default none)"),
             use("device_map", AUTO, note=" (whole-layout search: default sequential, Llama 3's order [TP, PP, DP]; "
                 "Megatron's [TP, DP, PP] where EP > 1)"),
             use("ep", AUTO, note=" (whole-layout search of a mixture of experts: auto = every divisor of the experts "
                 "that folds onto the layout's T x R, the default)"),
             use("etp", AUTO, note=" (whole-layout search: auto = every divisor of the node size that folds; "
                 "default 1)"),
             use("overlap_fb", note=" (whole-layout search of a mixture of experts: the overlap searched, on and off, "
                 "on every schedule; without it on dualpipe-v's own pairs only)"),
             *(use(k, note=" (whole-layout search: every candidate's)") for k in
               ("expert_imbalance", "capacity_factor", "fp8_dispatch", "a2a_hierarchical", "route_nodes",
                "overlap_sm_share")),
             use("plot", help="whole-layout search: the simulated candidates, step time vs memory per GPU, the "
                 "chosen plan marked"),
             use("no_progress"), use("json"), use("out_file", help="write the plan file", metavar="PLAN.json",
                                                           type=output_as("plan file", ("json",))),
             use("global_batch", note=" (or --global-tokens)"), use("global_tokens"), use("gpus"),
             use("device_memory"), use("force"), use("top"),
             use("max_stages"), use("uniform"), use("policies"), use("no_simulate"), use("no_baselines"),
             use("type_blind"),
             *(use(k, note="; the plan searches the layout: the file gives the model, sequence, global batch and GPU "
                   "budget") for k in _IMPORTS),
             use("emit")),
    "export": (use("to", required=True), use("schedule"), *map(use, _LAYOUT), use("plan"), *_costs(),
               *map(use, _IMPORTS), use("out_file", help="write here (default: standard output); torchtitan's "
                                        "schedule CSV goes beside it")),
    "validate": (use("schedules"), use("devices", default=2, note=" (default 2)"),
                 use("microbatches", note=" (default 2D)"), use("dp", default=1),
                 use("tp", note="; default: the profile's, else 1 (a profile must have been calibrated at it)"),
                 use("chunks"), use("steps", default=20),
                 use("model", note="; default: the profile's, else tiny"), use("micro_batch"),
                 use("dtype", default=None, note="; default: the profile's, else fp32; calibrates in it"),
                 use("warmup"), use("quiet_runs"), use("max_runs"), use("max_spread"), use("max_foreign"),
                 use("max_drift"),
                 use("ep", note="; a mixture of experts over the data-parallel replicas (T = 1); default: the "
                     "profile's, else 1 (a profile must have been calibrated at it)"),
                 use("overlap_fb", note=" (the executor runs each pair's F and B as interleaved segments; "
                     "dualpipe-v pairs its own without it)"),
                 use("cluster", note="; a mixed cluster only: each schedule runs with the typed split and the uniform "
                                     "one, the slower pools' ranks slowed on both sides (as run --cluster)"),
                 use("calibration_profile", help="calibration profile; default: calibrate now, in the same sitting as "
                     "the runs, and write it beside --plot"),
                 use("plot", default="out/validate.png", help="overlay figure (default out/validate.png)"),
                 use("json"), use("report")),
    "calibrate": (use("model", default="tiny", note="; default tiny; a model file's every layer is measured"),
                  use("micro_batch"), use("tp", default=1, note="; the layers are measured as one TP rank's shards "
                                          "(1/T), the group's all-reduce over gloo"),
                  use("ep", default=1, note="; a mixture of experts: its expert layers at the routed token counts "
                      "of E EP ranks, the executor's all-to-all over E gloo ranks"),
                  use("ranks"), use("timings"), use("runtime_steps"), use("runtime_repeats"),
                  use("dtype", note=" (default fp32)"),
                  use("out_file", default="out/calibration.yaml", help="profile file (default out/calibration.yaml)",
                      type=output_as("calibration profile", ("yaml", "yml")))),
}


# options whose value is a preset's name or a file (a path, or PATH:NODES / PATH.py:FUNC): read by
# the command when it is a file. The other inputs and outputs say so by their type's ``role``
# (:mod:`experiments.checks`).
NAMED_INPUTS = ("model", "cluster", "profile", "plan")


def file_roles(parser) -> dict[str, tuple[str, str]]:
    """A command parser's files: dest -> (flag, role ``"in"`` / ``"out"``), from the options'
    checked types (their ``role``) and :data:`NAMED_INPUTS`."""
    out = {}
    for a in parser._actions:
        role = getattr(a.type, "role", None) or ("in" if a.dest in NAMED_INPUTS else None)
        if role in ("in", "out") and a.option_strings:
            out[a.dest] = (max(a.option_strings, key=len), role)
    return out


def _input_paths(dest: str, value: str) -> list[str]:
    """The existing files an input option's value names (``PATH:NODES`` / ``PATH.py:FUNC`` too)."""
    import os
    names = [value] + ([value.rsplit(":", 1)[0]] if dest in NAMED_INPUTS and ":" in value else [])
    return [n for n in names if os.path.isfile(n)]


def check_files_apart(args) -> None:
    """Refuse (one ValueError line, before any work) an output file that is one of the command's
    inputs (``--trace`` onto the ``--cluster`` YAML just read) or another of its outputs. Devices
    and this process's descriptors (``/dev/null``, ``/dev/stdout``) may be named by several."""
    import os
    roles = vars(args).get("_files") or {}
    given = []
    for dest, (flag, role) in roles.items():
        v = vars(args).get(dest)
        v = v if isinstance(v, str) else getattr(v, "path", None)     # values read while parsing: their file
        if v:
            given.append((flag, role, dest, v))
    inputs = [(flag, p) for flag, role, dest, v in given if role == "in" for p in _input_paths(dest, v)]
    seen: list[tuple[str, str]] = []
    for flag, role, _, v in given:
        if role != "out" or (os.path.exists(v) and not os.path.isfile(v)):
            continue
        for in_flag, path in inputs:
            if os.path.exists(v) and os.path.samefile(v, path):
                raise ValueError(f"{flag} {v} is the file {in_flag} reads ({path}); writing it would overwrite that "
                                 f"input: give {flag} another path")
        real = os.path.realpath(v)
        for other_flag, other in seen:
            if other == real:
                raise ValueError(f"{other_flag} and {flag} both write {v}; give each its own file")
        seen.append((flag, real))


def row(key: str) -> Option:
    return table()[key]


def _list_type(opt: Option, auto: bool):
    """``"4,8"`` -> (4, 8), each value checked as the row's scalar is (``auto``: ``"auto"`` stays
    :data:`AUTO_VALUE`, told apart from an option not given, None; :func:`auto_values` reads both)."""
    what = f"values out of {', '.join(map(str, opt.choices))}" if opt.choices else \
        "integers >= 1 (e.g. 4,8)" if opt.type is positive_int else "values"

    def parse(text: str):
        if auto and text.strip() == AUTO_VALUE:
            return AUTO_VALUE
        parts = [t.strip() for t in str(text).split(",")]
        vals = []
        for t in parts:
            try:
                vals.append(opt.scalar(t))
            except (argparse.ArgumentTypeError, ValueError):
                which = f" ({t!r} is not)" if len(parts) > 1 else ""
                raise argparse.ArgumentTypeError(f"expected {'auto or ' if auto else ''}comma-separated {what}; "
                                                 f"got {text!r}{which}") from None
        return tuple(dict.fromkeys(vals))
    parse.__name__ = "auto_or_list" if auto else "list"
    return parse


def add_options(p, command: str, *, only: tuple[str, ...] | None = None) -> None:
    """Add ``command``'s rows (:data:`COMMANDS`) to parser ``p``, each in its grammar; the parser
    remembers which (``_options``: key -> grammar) for :func:`fields_of`."""
    taken = {}
    for u in COMMANDS[command]:
        if only is not None and u.key not in only:
            continue
        opt = row(u.key)
        default = opt.default if u.default is ... else u.default
        help_text = (u.help if u.help is not None and opt.field is None else opt.help) + u.note
        help_text = help_text.replace("{default}", str(default))
        kw: dict = {"dest": opt.name, "default": default, "help": help_text}
        if u.required:
            kw["required"] = True
        if isinstance(opt.action, tuple):        # an optional value: (nargs, the value when the flag is alone)
            kw.update(nargs=opt.action[0], const=opt.action[1], metavar=opt.metavar)
        elif opt.action is not None:
            kw["action"] = opt.action
            if opt.action == "append":
                kw.update(type=opt.type, metavar=opt.metavar)
        elif u.grammar == SCALAR:
            kw.update(type=u.type or opt.type, metavar=u.metavar or opt.metavar)
            if opt.choices is not None:
                kw["choices"] = list(opt.choices)
        else:
            kw["type"] = _list_type(opt, u.grammar == AUTO)
            kw["metavar"] = ("auto|" if u.grammar == AUTO else "") + "LIST"
        p.add_argument(*opt.flags, *u.extra_flags, **kw)
        taken[u.key] = u.grammar
    p.set_defaults(_options={**(p.get_default("_options") or {}), **taken})


def auto_values(value) -> tuple | None:
    """An auto-or-list option's values: None where the search chooses (``auto`` or not given)."""
    return None if value is None or value == AUTO_VALUE else value


def grammar_of(args, key: str) -> str | None:
    """The grammar in which the parsed command took row ``key`` (None: not at all)."""
    return (vars(args).get("_options") or {}).get(key)


def fields_of(args, record: str) -> dict:
    """The values of ``record``'s fields (``"Layout"``, ``"Parallel"``, ``"Job"``,
    ``"ClusterChoice"``, ``"Faults"``, ``"RunConfig"``) that the parsed options give: the rows the
    command took as scalars, by field name; an option not given (None) is left out (the record's
    default applies), a ``--no-x`` flag fills its field negated."""
    out = {}
    o = vars(args)
    for key, grammar in (o.get("_options") or {}).items():
        opt = row(key)
        if opt.record != record or grammar != SCALAR:
            continue
        v = o.get(opt.name)
        if v is None:
            continue
        if opt.invert:
            v = not v
        elif opt.action == "append":
            v = tuple(v)
        out[opt.attr] = v
    return out
