"""Published H100 training runs (``presets/measurements/h100/h100.csv``) read into jobs.

Three sources, each row a measured run with its layout (the folder's README says where each
comes from and what was corrected against the paper):

* ``llama3-paper``: Llama 3 Table 4, Llama 3 405B on 8,192 and 16,384 H100 SXM 80 GB (700 W),
  8 per server on NVLink, RoCE 400 Gb/s per GPU, pods of 3,072 GPUs at full bisection and 1:7 above
  them: the ``h100-pods`` cluster (pods of 8,192 GPUs at 7:1; a 3,072-GPU pod is not a multiple of
  its 32-node rails, so the pod boundary sits further out than Meta's: the 8,192-GPU row runs in one
  pod, the 16,384-GPU rows in two). Ranks in Llama 3's order [TP, CP, PP, DP] (``sequential``
  map); TP 8 with sequence parallelism; interleaved with one layer per chunk ((126 + 2) / 16 = 8
  chunks on a device: the paper's balanced schedule leaves the first chunk the embedding alone
  and the last the output head and loss alone, as pipetwin's default partition does); DP as
  FSDP that shards gradients and optimizer state and keeps the weights gathered after the
  forward (``zero 3`` without ``reshard_after_forward``: gathered once per step; with CP the
  shards span R x C, as torchtitan's dp_shard x cp); CP 16 of the 131k
  row exchanges K/V by all-gather (the paper's); micro-batch one sequence, so N = the batch
  per DP group; no recomputation at 8k (the paper), none assumed at 131k.
* ``torchtitan-bench``: torchtitan's H100 benchmark (December 2024) on Grand Teton hosts, H100
  with 96 GB HBM2e at 2.4 TB/s capped at 500 W (``grand-teton-h100`` cluster); FSDP2
  (``zero 3``, weights resharded after each forward when there is no pipeline, torchtitan's
  default); its "selective" activation checkpointing is per-op (every second matmul recomputed),
  priced as pipetwin's ``selective`` (the attention core re-run in B: at Llama 3.1 8B and 8k
  tokens 8% of a layer's FLOPs added, per-op SAC 9%); Float8 as torchao's dynamic tensorwise
  scaling (``fp8_recipe tensorwise``).
* ``megatron-bridge-25.11``: NVIDIA's Megatron-Bridge summary, DGX H100 (``dgx-h100-ib``), FP8
  with current scaling (``tensorwise``), micro-batch 1, the distributed optimizer (``zero 1``;
  the 8B row's Megatron-FSDP: ``zero 3``), sequence parallelism with TP and its communication
  overlapped with the GEMMs (the H100 recipes' ``tp_comm_overlap`` with userbuffers:
  ``tp_overlap``), CP by P2P ring.

:func:`not_expressible` names what a row uses that pipetwin does not model (torch.compile's fused
kernels, AsyncTP's overlapped collectives): such rows are listed, never fitted or predicted.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, fields
from importlib import resources

from .job import Job

MEASUREMENTS = "presets/measurements/h100/h100.csv"
SOURCES = ("llama3-paper", "torchtitan-bench", "megatron-bridge-25.11")
# the model presets of the models the rows name (Llama 3.1 has Llama 3's dimensions; its longer
# rotary context changes no cost)
MODELS = {"llama3-405b": "llama3-405b", "llama3.1-405b": "llama3-405b", "llama3.1-8b": "llama3-8b",
          "llama3-8b": "llama3-8b", "llama3.1-70b": "llama3-70b", "llama3-70b": "llama3-70b"}
CLUSTERS = {"llama3-paper": "h100-pods", "torchtitan-bench": "grand-teton-h100",
            "megatron-bridge-25.11": "dgx-h100-ib"}
GPUS_PER_NODE = 8
# what a row's ``extras`` may hold that pipetwin does not model, and why
# (torch.compile: its fused kernels are not priced; AsyncTP: the TP collectives decomposed and
# overlapped with the matmuls, which --tp-overlap's whole-collective overlap does not describe)
UNMODELLED = {"torch.compile": "torch.compile", "AsyncTP": "AsyncTP"}


@dataclass(frozen=True)
class PublishedRun:
    """One row of ``h100.csv`` (numbers parsed; an empty cell is None)."""

    source: str
    table: str
    model: str
    gpus: int
    gpu: str
    precision: str
    tp: int
    cp: int
    pp: int
    vp: int | None
    dp: int
    fsdp: str
    micro_batch: int | None
    local_batch: int | None
    global_batch: int | None
    seq_len: int
    schedule: str
    recompute: str
    extras: str
    tokens_per_gpu_s: float | None
    tflops_per_gpu: float | None
    mfu: float | None
    memory_gib: float | None
    notes: str

    @property
    def name(self) -> str:
        """A short label, unique in the file: table, GPUs, layout and what is switched on."""
        lay = "x".join(f"{k}{v}" for k, v in (("TP", self.tp), ("CP", self.cp), ("PP", self.pp), ("DP", self.dp))
                       if v > 1)
        src = {"llama3-paper": "Llama 3", "torchtitan-bench": "torchtitan",
               "megatron-bridge-25.11": "Megatron-Bridge"}[self.source]
        tab = f" T{self.table}" if self.table.isdigit() else ""
        what = f" {self.schedule}" if self.schedule and self.pp > 1 else ""
        extra = f" + {self.extras}" if self.extras and self.extras not in ("first and last stage one layer fewer",) \
            and not self.extras.startswith("gradient accumulation") else ""
        seq = f"seq {self.seq_len // 1024}k"
        return f"{src}{tab} {self.model} {self.gpus} GPUs {lay} {seq} {self.precision}{what}{extra}"

    @property
    def microbatches(self) -> int:
        """N: micro-batches a pipeline runs per step (Llama 3, torchtitan with PP, Megatron: the
        batch per DP group in micro-batches of one sequence; FSDP without PP: one micro-batch of
        the local batch)."""
        if self.source == "megatron-bridge-25.11":
            return self.global_batch // (self.dp * (self.micro_batch or 1))
        if self.pp > 1 or self.source == "llama3-paper":
            return self.local_batch
        return 1

    @property
    def sequences_per_microbatch(self) -> int:
        if self.source == "torchtitan-bench" and self.pp == 1:
            return self.local_batch
        return self.micro_batch or 1

    @property
    def tokens_per_step(self) -> int:
        """Tokens a step trains: micro-batches x sequences x sequence length x DP groups."""
        return self.microbatches * self.sequences_per_microbatch * self.seq_len * self.dp


def _num(v: str, kind=int):
    return None if v.strip() == "" else kind(v)


def load_runs(source: str | None = None) -> list[PublishedRun]:
    """The rows of ``h100.csv`` (of ``source`` only, when given), in the file's order."""
    if source is not None and source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    with resources.files("cost_models").joinpath(MEASUREMENTS).open() as f:
        rows = list(csv.DictReader(f))
    ints = ("gpus", "tp", "cp", "pp", "vp", "dp", "micro_batch", "local_batch", "global_batch", "seq_len")
    floats = ("tokens_per_gpu_s", "tflops_per_gpu", "mfu", "memory_gib")
    out = []
    for r in rows:
        vals = {f.name: _num(r[f.name], int) if f.name in ints else _num(r[f.name], float) if f.name in floats
                else r[f.name].strip() for f in fields(PublishedRun)}
        run = PublishedRun(**vals)
        if source is None or run.source == source:
            out.append(run)
    return out


def not_expressible(run: PublishedRun) -> str | None:
    """What the row uses that pipetwin does not model, in words (None: every part is modelled)."""
    why = [text for key, text in UNMODELLED.items() if key in run.extras]
    return "; ".join(why) or None


def chunks_of(run: PublishedRun) -> int:
    """Model chunks per pipeline device: Megatron's ``vp``; Llama 3's balanced interleaved schedule
    one layer per chunk ((layers + embedding + head) / PP); 1 without interleaving."""
    if run.vp:
        return run.vp
    if run.source == "llama3-paper":
        from .model_spec import load_model
        return (load_model(MODELS[run.model]).layers + 2) // run.pp
    return 2 if "interleaved" in run.schedule else 1


def schedule_of(run: PublishedRun) -> str:
    if run.pp == 1:
        return "dapple"      # one device: a plain loop of F and B
    return "interleaved" if "interleaved" in run.schedule else "dapple"


def job_of(run: PublishedRun) -> Job:
    """The row as a pipetwin job (module docstring: what each source's layout is taken to be)."""
    precision = "fp8" if run.precision.startswith("fp8") else run.precision
    fp8 = {"precision": "fp8", "fp8_recipe": "tensorwise"} if precision == "fp8" else {"precision": precision}
    zero = 1 if run.source == "megatron-bridge-25.11" and run.fsdp == "" else 3
    fields_ = dict(schedule=schedule_of(run), devices=run.pp, microbatches=run.microbatches, replicas=run.dp,
                   model=MODELS[run.model], cluster=f"{CLUSTERS[run.source]}:{run.gpus // GPUS_PER_NODE}",
                   tp=run.tp, sequence_parallel=run.tp > 1, cp=run.cp, seq_len=run.seq_len,
                   micro_batch=run.sequences_per_microbatch, recompute=run.recompute or "none",
                   **fp8)
    if run.dp > 1:
        fields_["zero"] = zero
        if zero == 3 and run.pp == 1 and run.source != "llama3-paper":
            fields_["reshard_after_forward"] = True      # FSDP2's / Megatron-FSDP's default without PP
    if run.pp > 1:
        fields_["chunks"] = chunks_of(run)
    if run.cp > 1:
        fields_["cp_comm"] = "allgather" if run.source == "llama3-paper" else "ring"
    if run.source == "llama3-paper":
        fields_["device_map"] = "sequential"        # [TP, CP, PP, DP]
    if run.source == "megatron-bridge-25.11" and run.tp > 1:
        fields_["tp_overlap"] = True                # the recipes' tp_comm_overlap (userbuffers)
    return Job.of(**fields_)
