"""Megatron-LM and torchtitan, in and out: one table maps their arguments to a job's fields.

A job (:class:`cost_models.job.Job`) is written as the arguments another framework trains it with
(:func:`export_job`: Megatron-LM's ``pretrain_gpt.py`` flags, torchtitan's ``--section.field``
overrides, or torch.distributed.pipelining's CSV), and a file of such arguments is read back into
the parts of a job (:func:`read_megatron`, :func:`read_torchtitan`). Both directions read the same
rows (:data:`MEGATRON`, :data:`TORCHTITAN`): a row names the upstream argument, the job field it
fills (``Parallel.tp``, ``ModelSpec.hidden``, ``Layout.devices`` ...), the upstream default (what
its absence means) and the conversion both ways. Arguments that several fields share (the
schedule's virtual stages and layout string, ZeRO's distributed optimizer and FSDP flags, the
precision flags, the data-parallel degrees) are rows of their own whose two functions stand side
by side. Export then import gives the same job record (the model as an explicit spec), and so the
same simulated time to the bit (``tests/test_frameworks.py``).

Names, as of the sources read (Megatron-LM d98e8a64, 2026-08-22; torchtitan b5bcd76c, 2026-08-21):

* Megatron-LM ``megatron/training/arguments.py`` (``_add_network_size_args``, ``_add_distributed_args``,
  ``_add_moe_args``, ``_add_mla_args``, ``_add_data_args``) and the dataclasses it turns into flags
  by ``megatron/training/argument_utils.py`` (``--field-name``, ``--no-``/``--disable-`` for a true
  default): ``megatron/core/model_parallel_config.py`` (``--tensor-model-parallel-size``,
  ``--pipeline-model-parallel-size``, ``--context-parallel-size``, ``--expert-model-parallel-size``,
  ``--expert-tensor-parallel-size`` (None: = TP), ``--sequence-parallel``, ``--bf16``, ``--fp16``,
  ``--tp-comm-overlap``, ``--overlap-moe-expert-parallel-comm``),
  ``megatron/core/transformer/transformer_config.py`` (``--num-layers``, ``--hidden-size``,
  ``--num-attention-heads``, ``--num-query-groups``, ``--ffn-hidden-size``, ``--kv-channels``,
  ``--normalization``, ``--disable-bias-linear``, ``--add-qkv-bias``, ``--hidden-dropout``,
  ``--attention-dropout``, ``--recompute-granularity`` / ``-method`` / ``-num-layers``,
  ``--fp8-format``, ``--moe-router-topk``, ``--moe-ffn-hidden-size``,
  ``--moe-shared-expert-intermediate-size``, ``--moe-shared-expert-gate``,
  ``--moe-router-score-function``, ``--moe-expert-capacity-factor``, ``--qk-layernorm``,
  ``--attention-backend``), ``megatron/training/config/training_config.py`` and ``common_config.py``
  (``--micro-batch-size``, ``--global-batch-size``, ``--vocab-size``, ``--padded-vocab-size``,
  ``--tokenizer-type``, ``--use-megatron-fsdp``, ``--use-torch-fsdp2``). Megatron pads the vocabulary
  to a multiple of ``--make-vocab-size-divisible-by`` x TP; its ``--ffn-hidden-size`` defaults to
  4h (SwiGLU: int(8h/3 / 64) x 64). Its pipeline schedules (``megatron/core/pipeline_parallel/
  schedules.py``, ``combined_1f1b.py``): 1F1B (pipetwin's ``dapple``), interleaved 1F1B
  (``interleaved``) and its combined-1F1B overlap of expert all-to-alls
  (``--overlap-moe-expert-parallel-comm``: ``interleaved --variant a2a-overlap``); nothing else.
  Its functional tests' ``model_config.yaml`` hold the flags as a ``MODEL_ARGS`` mapping
  (``--bf16: true``), their recipes the GPUs as ``nodes`` and ``gpus`` (per node).
* torchtitan ``torchtitan/config/configs.py`` (``TrainingConfig``, ``ParallelismConfig``), the
  frozen command line of ``tests/unit_tests/test_no_new_cli_options.py``,
  ``torchtitan/distributed/activation_checkpoint.py`` (the ``activation-checkpoint:full|selective|
  none`` subcommand; selective by default), ``torchtitan/distributed/fsdp.py`` (reshard after
  forward: ``default`` = not under PP), ``torchtitan/distributed/pipeline_parallel.py`` (stages =
  ceil((L + first_less + last_less) / layers_per_stage), the embedding and the head weighing
  ``pipeline_parallel_first_stage_less_layers`` / ``_last_`` layers, default 1, split evenly with the
  remainder on the first stages; without layers_per_stage 1 stage per rank for single-stage
  schedules, 2 for looped; ``pipeline_parallel_schedule_csv`` runs ``_PipelineScheduleRuntime``).
  The model is torchtitan's ``--module/--config`` recipe, off its command line: an override file
  brings no model (give ``--model``). Float8 is set in the recipe too.

The model a Megatron file gives is whatever its flags combine: the MLP (``--swiglu``: a llama-kind
block, else gpt), grouped-query attention (``--group-query-attention --num-query-groups``),
``--untie-embeddings-and-output-weights``, dropout, attention backend (unfused/local: eager, else a
fused kernel), MoE and MLA fields. The norm, the position embedding and the biases follow the MLP's
kind (gpt: LayerNorm, learned positions, biases; llama: RMSNorm, rotary, none): a flag that says
otherwise is listed as not modelled. Flags that change the cost but that pipetwin does not model are
listed (:attr:`Imported.unmodelled`), flags no row reads are listed as ignored; contradictions
(``--bf16`` with ``--fp16``, a global batch that is no multiple of micro x DP, ...) are one line.
"""
from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from schedules.torch_interop import NEAREST_SINGLE_COPY, single_copy_refusal

from .model_spec import ModelSpec
from .parallel import Parallel

TARGETS = ("megatron", "torchtitan", "torch-csv")
MEGATRON_VOCAB_DIVISOR = 128           # --make-vocab-size-divisible-by's default
GPT2_VOCAB = 50257                     # GPT2BPETokenizer's vocabulary (Megatron's functional tests)

# the schedules each target runs, and for the others the nearest one it does run (and why)
MEGATRON_RUNS = ("dapple", "interleaved")
TORCH_NAMES = {"gpipe": "GPipe", "dapple": "1F1B", "interleaved": "Interleaved1F1B", "zb-v": "ZBVZeroBubble",
               "dualpipe-v": "DualPipeV"}
TWO_COPIES = ("chimera", "bitpipe", "bitpipe-zb")


def runs_on(target: str) -> tuple[str, ...]:
    """The schedule families ``target`` runs (torchtitan and torch's CSV: every single-copy family)."""
    from schedules import names
    if target == "megatron":
        return MEGATRON_RUNS
    return tuple(n for n in names() if n not in TWO_COPIES)
NEAREST = {   # family -> (Megatron-LM's nearest, why; a single-copy nearest for torch's format)
    "gpipe": ("dapple", "Megatron-LM has no GPipe flush order (its 1F1B runs the same micro-batches)"),
    "zb-h1": ("dapple", "Megatron-LM has no split-backward (zero-bubble) schedule"),
    "zb-h2": ("dapple", "Megatron-LM has no split-backward (zero-bubble) schedule"),
    "zb-auto": ("dapple", "Megatron-LM has no split-backward (zero-bubble) schedule"),
    "zb-v": ("interleaved --chunks 2", "Megatron-LM has no V-shaped placement or split backward"),
    "dualpipe-v": ("interleaved --chunks 2 --variant a2a-overlap", "Megatron-LM has no V-shaped placement"),
    "chimera": ("dapple", "Megatron-LM has no bidirectional pipelines"),
    "bitpipe": ("interleaved", "Megatron-LM has no bidirectional pipelines"),
    "bitpipe-zb": ("interleaved", "Megatron-LM has no bidirectional pipelines"),
}


def _one_line(msg: str) -> ValueError:
    return ValueError(msg)


# ============================================================================ the job as flat values
@dataclass(frozen=True)
class View:
    """A job as the tables read and write it: the model (``spec``, at the job's micro-batch and
    sequence length), the layout and parallel records, and the derived global batch."""

    spec: ModelSpec
    layout: Any                 # cost_models.job.Layout
    parallel: Parallel
    partition: tuple[int, ...] | None
    eager: bool = True
    family: dict | None = None  # zb-auto's costs: it orders its ops from them (cost_models.bind.costed_family)

    @property
    def global_batch(self) -> int:
        return self.spec.micro_batch * self.layout.microbatches * self.layout.replicas

    @property
    def precision(self) -> str:
        """The GEMMs' format as a trainer sets it: the record's, else bf16 for a 16-bit model, fp32 for a
        32-bit one."""
        if self.parallel.precision is not None:
            return self.parallel.precision
        return "bf16" if self.spec.dtype_bytes == 2 else "fp32"


def job_view(job) -> View:
    """The :class:`View` of ``job``: its model loaded and sized, a plan's own job; what has no
    model dimensions (unit costs, a profile, stage costs, a PipeDream layer profile) is refused."""
    from .job import DEFAULT_MODEL
    from .model_spec import load_model
    if job.plan is not None:
        make = getattr(job.plan, "job", None)
        if make is None:
            raise _one_line(f"{job.plan.path} is a DAPPLE plan (stages on their own replicas); export a whole-layout "
                            f"plan (pipetwin plan --search layout) or give the layout options")
        job = make(eager=job.eager)
    if job.source != "transformer":
        flag = {"unit": "--unit-costs", "profile": "--profile", "stage-costs": "--stage-costs",
                "layer-profile": "a FILE.txt layer profile"}[job.source]
        raise _one_line(f"export writes a model's dimensions; {flag} has none: give --model (a preset, YAML or "
                        f"config.json)")
    model = job.model if job.model is not None else DEFAULT_MODEL
    spec = model if isinstance(model, ModelSpec) else load_model(model)
    spec = job.parallel.sized(spec)
    if spec.kind == "bert":
        raise _one_line(f"model {spec.name} is a BERT encoder; the exports write decoders (Megatron-LM's "
                        f"pretrain_gpt.py, torchtitan's LLMs)")
    part = job.partition
    if part == "time":
        raise _one_line("--partition time reads a profile's layer times; give the layer counts (e.g. 9,8,8,9)")
    family = None
    if job.layout.schedule == "zb-auto" and job.layout.schedule_file is None:
        from .bind import costed_family, load_inputs
        family = costed_family(job, load_inputs(job))       # the order the simulator runs
    return View(spec=spec, layout=job.layout, parallel=job.parallel, partition=part, eager=job.eager,
                family=family)


# ============================================================================ reading files of arguments
def _lines(text: str) -> str:
    """``text`` with ``\\`` continuations joined and ``#`` comments dropped."""
    out = []
    for line in text.replace("\\\r\n", " ").replace("\\\n", " ").splitlines():
        try:
            toks = shlex.split(line, comments=True)
        except ValueError as e:
            raise _one_line(f"cannot split the line {line.strip()[:60]!r}: {e}") from None
        out.append(toks)
    return out


_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


@dataclass
class Args:
    """Arguments as read from a file: ``values`` flag -> value (True for a switch, a string, or a
    list of strings for a flag given several values), ``env`` the environment assignments,
    ``launcher`` the torchrun options before the script, ``extra`` bare words after it
    (torchtitan's ``activation-checkpoint:full``), ``where`` the file (for messages)."""

    where: str
    values: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    launcher: dict = field(default_factory=dict)
    extra: list = field(default_factory=list)
    used: set = field(default_factory=set)

    def put(self, flag: str, value) -> None:
        if flag in self.values and self.values[flag] != value:
            raise _one_line(f"{self.where}: {flag} is given twice ({self.values[flag]!r} and {value!r}); keep one")
        self.values[flag] = value

    def get(self, flag: str, default=None):
        self.used.add(flag)
        return self.values.get(flag, default)

    def has(self, flag: str) -> bool:
        self.used.add(flag)
        return flag in self.values

    def _number(self, flag: str, default, cast, what: str):
        v = self.get(flag)
        if v is None or v is False:
            return default
        try:
            return cast(str(v))
        except ValueError:
            raise _one_line(f"{self.where}: {flag} takes {what}; got {v!r}") from None

    def int(self, flag: str, default=None) -> int | None:
        return self._number(flag, default, int, "a whole number")

    def required_int(self, flag: str, default=None) -> int:
        """A whole number Megatron-LM requires (no default of its own): missing is one line."""
        v = self.int(flag, default)
        if v is None:
            raise _one_line(f"{self.where}: {flag} is missing (Megatron-LM requires it)")
        return v

    def float(self, flag: str, default=None) -> float | None:
        return self._number(flag, default, float, "a number")

    def switch(self, flag: str) -> bool:
        v = self.get(flag, False)
        if isinstance(v, bool):
            return v
        low = str(v).lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise _one_line(f"{self.where}: {flag} is a switch; got the value {v!r}")

    def str(self, flag: str, default=None) -> str | None:
        v = self.get(flag)
        if v is None or v is False:
            return default
        if v is True:
            raise _one_line(f"{self.where}: {flag} takes a value")
        return v if isinstance(v, str) else " ".join(map(str, v))

    def left(self) -> list[str]:
        """The flags no row read (ignored)."""
        return [f for f in self.values if f not in self.used]


def _tokens_to_args(tokens: list[str], where: str, args: Args, *, launcher_ok: bool = True) -> None:
    """Fill ``args`` from command-line ``tokens``: env assignments and a launcher (``torchrun``,
    ``python -m torch.distributed.run``, ``./run_train.sh``...) before the first ``--flag`` of
    the script, then ``--flag value`` / ``--flag=value`` / ``--flag v1 v2`` / ``--flag``."""
    i = 0
    # before the script: environment, the launcher and its options
    script_at = next((k for k, t in enumerate(tokens) if t.endswith(".py") or t.endswith(".sh")), None)
    if script_at is not None and launcher_ok:
        head, tokens = tokens[:script_at], tokens[script_at + 1:]
        k = 0
        while k < len(head):
            t = head[k]
            if _ENV.fullmatch(t):
                key, val = t.split("=", 1)
                args.env[key] = val
            elif t.startswith("--"):
                key, _, val = t[2:].partition("=")
                if not val and k + 1 < len(head) and not head[k + 1].startswith("-"):
                    val, k = head[k + 1], k + 1
                args.launcher[key.replace("_", "-")] = val
            k += 1
    while i < len(tokens):
        t = tokens[i]
        if _ENV.fullmatch(t) and not t.startswith("-"):
            key, val = t.split("=", 1)
            args.env[key] = val
            i += 1
            continue
        if t in ("export", "exec"):
            i += 1
            continue
        if not t.startswith("--"):
            args.extra.append(t)
            i += 1
            continue
        flag, eq, val = t.partition("=")
        i += 1
        if eq:
            args.put(flag, val)
            continue
        vals = []
        while i < len(tokens) and not tokens[i].startswith("--") and ":" not in tokens[i]:
            vals.append(tokens[i])
            i += 1
        args.put(flag, True if not vals else vals[0] if len(vals) == 1 else vals)


def read_args(text: str, where: str) -> Args:
    """A file of arguments: a YAML mapping (``MODEL_ARGS:`` of ``--flag: value``, as Megatron-LM's
    functional tests write them, with optional ``nodes`` / ``gpus`` per node / ``ENV_VARS``; or the
    mapping itself) or a command line (one or many lines, ``\\`` continuations, a launcher and
    environment assignments before the script)."""
    args = Args(where)
    data = None
    if not text.lstrip().startswith("--") and ":" in text:
        import yaml
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            data = None
    if isinstance(data, dict):
        block = data.get("MODEL_ARGS", data)
        if not isinstance(block, dict):
            raise _one_line(f"{where}: MODEL_ARGS must be a mapping of '--flag: value'")
        for k, v in block.items():
            k = str(k)
            if not k.startswith("--"):
                if block is data and k in ("nodes", "gpus", "ENV_VARS", "TEST_TYPE", "LAUNCHER", "spec"):
                    continue
                raise _one_line(f"{where}: {k!r} is not a flag (a MODEL_ARGS key is '--flag')")
            if v is False or v is None:
                continue
            args.put(k, True if v is True else [str(x) for x in v] if isinstance(v, list) else str(v))
        spec = data.get("spec") if isinstance(data.get("spec"), dict) else data
        for key in ("nodes", "gpus"):
            if key in spec:
                args.launcher[key] = str(spec[key])
        env = data.get("ENV_VARS")
        if isinstance(env, dict):
            args.env.update({str(k): str(v) for k, v in env.items()})
        return args
    tokens = [t for line in _lines(text) for t in line]
    if not tokens:
        raise _one_line(f"{where}: no arguments in the file")
    _tokens_to_args(tokens, where, args)
    return args


def _world(args: Args) -> int | None:
    """GPUs of the run: torchrun's --nproc-per-node x --nnodes, the recipe's nodes x gpus, or
    WORLD_SIZE / NGPU in the environment."""
    L, E = args.launcher, args.env
    per = L.get("nproc-per-node") or L.get("gpus") or E.get("GPUS_PER_NODE")
    nodes = L.get("nnodes") or L.get("nodes") or E.get("NNODES") or E.get("NUM_NODES") or "1"
    try:
        if per is not None:
            return int(per) * int(str(nodes).split(":")[-1])
        for key in ("WORLD_SIZE", "NGPU"):
            if key in E:
                return int(E[key])
    except ValueError:
        raise _one_line(f"{args.where}: the launcher's GPU count is no whole number ({per!r} x {nodes!r})") from None
    return None


# ============================================================================ the result of an import
@dataclass(frozen=True)
class Imported:
    """What a file of a framework's arguments gives: ``fields``, the job's flat fields
    (:meth:`cost_models.job.Job.of` names: schedule, devices, microbatches, replicas, chunks,
    variant, tp, zero, ...; ``model`` a :class:`ModelSpec` for Megatron-LM; ``partition``),
    ``global_batch`` in sequences, ``unmodelled`` (flags that change the cost but that pipetwin does
    not model, each with what it models instead), ``ignored`` (flags no row reads), ``source``."""

    source: str
    fields: dict
    global_batch: int
    unmodelled: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()

    def job(self, **more):
        """The job (more flat fields on top: the cluster, the cost model ...)."""
        from .job import Job
        return Job.of(**{**self.fields, **more})

    def notes(self) -> dict:
        return {"from": self.source, "not_modelled": list(self.unmodelled), "ignored": list(self.ignored)}


# ============================================================================ Megatron-LM: the table
@dataclass(frozen=True)
class Row:
    """One row of a framework's table: ``flags`` it reads and writes, ``field`` it fills (for the
    reader of the table), ``read(args, out)`` filling ``out`` (flat fields and model fields,
    ``model.x``), ``write(view) -> [(flag, value)]`` (value True: a switch; None: not written)."""

    flags: tuple[str, ...]
    field: str
    read: Callable
    write: Callable


def _model_int(flag: str, key: str, default=None, always=True):
    """A model dimension: ``--flag N`` <-> spec.key (required: Megatron-LM has no default)."""
    def read(a: Args, out: dict):
        out["model." + key] = a.required_int(flag, default)

    def write(v: View):
        val = getattr(v.spec, key)
        return [(flag, val)] if always or val != default else []
    return Row((flag,), f"ModelSpec.{key}", read, write)


def _par_int(flag: str, key: str, default: int = 1, always: bool = True):
    def read(a: Args, out: dict):
        out[key] = a.int(flag, default)

    def write(v: View):
        val = getattr(v.parallel, key)
        return [(flag, val)] if always or val != default else []
    return Row((flag,), f"Parallel.{key}", read, write)


def _par_switch(flag: str, key: str):
    def read(a: Args, out: dict):
        out[key] = a.switch(flag)

    def write(v: View):
        return [(flag, True)] if getattr(v.parallel, key) else []
    return Row((flag,), f"Parallel.{key}", read, write)


# --- the model's block
def _mg_kind_read(a: Args, out: dict):
    swiglu = a.switch("--swiglu")
    out["model.kind"] = "llama" if swiglu else "gpt"
    norm = a.str("--normalization", "LayerNorm")
    pos = a.str("--position-embedding-type", "learned_absolute")
    if a.switch("--use-rotary-position-embeddings"):
        pos = "rope"
    bias = not a.switch("--disable-bias-linear")
    want = ("RMSNorm", "rope", False) if swiglu else ("LayerNorm", "learned_absolute", True)
    for flag, have, should, what in (("--normalization", norm, want[0], "the norm"),
                                     ("--position-embedding-type", pos, want[1], "the positions"),
                                     ("--disable-bias-linear", bias, want[2], "the biases")):
        if have != should:
            kind = "SwiGLU (llama-kind)" if swiglu else "GeLU (gpt-kind)"
            shown = ("on" if not have else "off") if flag == "--disable-bias-linear" else have
            out.setdefault("_unmodelled", []).append(f"{flag} {shown} ({what} of a {kind} block priced as its kind's)")
    if a.switch("--add-qkv-bias"):
        if swiglu:
            out["model.qkv_bias"] = True
        else:
            out.setdefault("_unmodelled", []).append("--add-qkv-bias (a gpt-kind block has every bias)")
    if a.switch("--qk-layernorm"):
        if swiglu:
            out["model.qk_norm"] = True
        else:
            out.setdefault("_unmodelled", []).append("--qk-layernorm (priced on llama-kind blocks only)")


def _mg_kind_write(v: View):
    s = v.spec
    if s.kind == "gpt":
        return [("--normalization", "LayerNorm"), ("--position-embedding-type", "learned_absolute")]
    return [("--swiglu", True), ("--normalization", "RMSNorm"), ("--position-embedding-type", "rope"),
            ("--disable-bias-linear", True), ("--add-qkv-bias", True if s.qkv_bias else None),
            ("--qk-layernorm", True if s.qk_norm else None)]


def _mg_heads_read(a: Args, out: dict):
    if a.switch("--group-query-attention"):     # Megatron-LM reads --num-query-groups only with it (else:
        out["model.kv_heads"] = a.int("--num-query-groups", 1)    # listed as ignored, as Megatron ignores it)
    kv_ch = a.int("--kv-channels")
    if kv_ch is not None:
        out["model.head_size"] = kv_ch


def _mg_heads_write(v: View):
    s = v.spec
    out = [("--group-query-attention", True), ("--num-query-groups", s.kv)] if s.kv != s.heads else []
    if s.head_size is not None and s.head_size * s.heads != s.hidden and not s.is_mla:
        out.append(("--kv-channels", s.head_size))
    return out


def _mg_ffn_read(a: Args, out: dict):
    f = a.int("--ffn-hidden-size")
    if f is None:
        h = out["model.hidden"]
        f = int((4 * h * 2 / 3) / 64) * 64 if a.values.get("--swiglu") not in (None, False, "false") else 4 * h
    out["model.ffn_hidden"] = f


def _mg_ffn_write(v: View):
    return [("--ffn-hidden-size", v.spec.ffn)]


def _mg_vocab_read(a: Args, out: dict):
    tp = out["tp"]
    padded = a.int("--padded-vocab-size")
    div = a.int("--make-vocab-size-divisible-by", MEGATRON_VOCAB_DIVISOR)
    V = a.int("--vocab-size")
    tok = a.str("--tokenizer-type")
    a.has("--vocab-file"), a.has("--merge-file")
    if padded is not None:
        out["model.vocab"] = padded
        return
    if V is None:
        if tok == "GPT2BPETokenizer" or (tok is None and "--merge-file" in a.values):
            V = GPT2_VOCAB
        else:
            raise _one_line(f"{a.where}: the vocabulary size is the tokenizer's ({tok or 'none named'}): add "
                            f"--vocab-size N (before padding) to the file")
    m = div * tp
    out["model.vocab"] = -(-V // m) * m


def _mg_vocab_write(v: View):
    V, tp = v.spec.vocab, v.parallel.tp
    div = next((d for d in (128, 64, 32, 16, 8, 4, 2, 1) if V % (d * tp) == 0), 1)
    return [("--vocab-size", V), ("--make-vocab-size-divisible-by", div)]


def _mg_dropout_read(a: Args, out: dict):
    hd, ad = a.float("--hidden-dropout", 0.1), a.float("--attention-dropout", 0.1)
    out["model.dropout"] = bool(hd or ad)
    if bool(hd) != bool(ad):
        out.setdefault("_unmodelled", []).append(f"--hidden-dropout {hd:g} with --attention-dropout {ad:g} (priced "
                                                 f"as dropout in both)")


def _mg_dropout_write(v: View):
    return [] if v.spec.has_dropout else [("--hidden-dropout", 0.0), ("--attention-dropout", 0.0)]


def _mg_attention_read(a: Args, out: dict):
    backend = a.str("--attention-backend", "auto")
    out["model.attention"] = "eager" if backend in ("unfused", "local") else "flash"


def _mg_attention_write(v: View):
    return [("--attention-backend", "unfused")] if v.spec.attention_kind == "eager" else \
        [("--attention-backend", "flash")]


def _mg_tied_read(a: Args, out: dict):
    out["model.tied_embeddings"] = not a.switch("--untie-embeddings-and-output-weights")


def _mg_tied_write(v: View):
    return [] if v.spec.tied else [("--untie-embeddings-and-output-weights", True)]


def _mg_seq_read(a: Args, out: dict):
    s = out["model.seq_len"] = a.required_int("--seq-length")
    mpe = a.int("--max-position-embeddings")
    if mpe is not None and mpe != s and out.get("model.kind") == "gpt":
        out.setdefault("_unmodelled", []).append(f"--max-position-embeddings {mpe} (the position table is priced at "
                                                 f"--seq-length {s})")


def _mg_seq_write(v: View):
    return [("--seq-length", v.spec.seq_len), ("--max-position-embeddings", v.spec.seq_len)]


# --- mixtures of experts and latent attention
def _mg_moe_read(a: Args, out: dict):
    E = a.int("--num-experts")
    if not E:
        for f in ("--moe-router-topk", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
                  "--moe-layer-freq", "--moe-router-score-function", "--moe-shared-expert-gate",
                  "--moe-expert-capacity-factor", "--expert-tensor-parallel-size", "--moe-token-dispatcher-type"):
            a.has(f)
        return
    out["model.experts"] = E
    out["model.top_k"] = a.int("--moe-router-topk", 2)
    ef = a.int("--moe-ffn-hidden-size")
    if ef is not None and ef != out["model.ffn_hidden"]:
        out["model.expert_ffn"] = ef
    out["model.shared_ffn"] = a.int("--moe-shared-expert-intermediate-size", 0)
    out["model.shared_gate"] = a.switch("--moe-shared-expert-gate")
    out["model.router"] = a.str("--moe-router-score-function", "softmax")
    freq = a.str("--moe-layer-freq", "1")
    out["model.dense_layers"] = _dense_layers(freq, out["model.layers"], a.where)
    cf = a.float("--moe-expert-capacity-factor")
    out["capacity_factor"] = 0.0 if cf is None else cf
    out["etp"] = a.int("--expert-tensor-parallel-size", out["tp"])
    dispatcher = a.str("--moe-token-dispatcher-type", "allgather")
    deepep = a.switch("--moe-enable-deepep") or (dispatcher == "flex" and a.str("--moe-flex-dispatcher-backend",
                                                                                 "deepep") in ("deepep", "hybridep"))
    out["a2a_hierarchical"] = deepep
    if dispatcher == "allgather":
        out.setdefault("_unmodelled", []).append("--moe-token-dispatcher-type allgather (priced as all-to-all)")


def _dense_layers(freq: str, layers: int, where: str) -> int:
    """``--moe-layer-freq``: 1, or a list expression of 0 (dense) and 1 (MoE) whose zeros come first
    (DeepSeek's first dense blocks): their count."""
    freq = freq.strip()
    if freq.isdigit():
        if int(freq) != 1:
            raise _one_line(f"{where}: --moe-layer-freq {freq} mixes dense and MoE blocks along the model; pipetwin "
                            f"models the first blocks dense, then MoE (e.g. \"([0]*3+[1]*{layers - 3})\")")
        return 0
    if not re.fullmatch(r"[\[\]0-9*+(), ]+", freq):
        raise _one_line(f"{where}: --moe-layer-freq {freq!r}: expected 1 or a list expression of 0 and 1")
    pattern = eval(freq, {"__builtins__": {}}, {})        # digits, brackets, * and + only (checked above)
    pattern = list(pattern)
    if len(pattern) != layers or any(x not in (0, 1) for x in pattern):
        raise _one_line(f"{where}: --moe-layer-freq gives {len(pattern)} entries of 0/1; the model has {layers} blocks")
    k = pattern.index(1) if 1 in pattern else layers
    if any(x != 1 for x in pattern[k:]):
        raise _one_line(f"{where}: --moe-layer-freq {freq!r} mixes dense and MoE blocks along the model; pipetwin "
                        f"models the first blocks dense, then MoE")
    return k


def _mg_moe_write(v: View):
    s, p = v.spec, v.parallel
    if not s.is_moe:
        return []
    out = [("--num-experts", s.experts), ("--moe-router-topk", s.top_k), ("--moe-ffn-hidden-size", s.expert_width)]
    if s.shared_ffn:
        out.append(("--moe-shared-expert-intermediate-size", s.shared_ffn))
    if s.shared_gate:
        out.append(("--moe-shared-expert-gate", True))
    if s.router != "softmax":
        out.append(("--moe-router-score-function", s.router))
    if s.dense_layers:
        out.append(("--moe-layer-freq", f"([0]*{s.dense_layers}+[1]*{s.layers - s.dense_layers})"))
    if p.capacity_factor:
        out.append(("--moe-expert-capacity-factor", p.capacity_factor))
    out.append(("--expert-tensor-parallel-size", p.etp))
    if p.a2a_hierarchical:      # DeepEP: a token crosses the fabric once per remote node, then NVLink
        out += [("--moe-token-dispatcher-type", "flex"), ("--moe-flex-dispatcher-backend", "deepep")]
    else:                       # the all-to-all pipetwin prices (Megatron-LM's default is an all-gather)
        out.append(("--moe-token-dispatcher-type", "alltoall"))
    return out


def _mg_mla_read(a: Args, out: dict):
    if not a.switch("--multi-latent-attention"):
        for f in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim"):
            a.has(f)
        return
    out["model.kv_lora_rank"] = a.int("--kv-lora-rank", 32)
    out["model.q_lora_rank"] = a.int("--q-lora-rank", 0)
    out["model.head_size"] = a.int("--qk-head-dim", 128)
    out["model.rope_head_dim"] = a.int("--qk-pos-emb-head-dim", 64)
    out["model.v_head_size"] = a.int("--v-head-dim", 128)


def _mg_mla_write(v: View):
    s = v.spec
    if not s.is_mla:
        return []
    return [("--multi-latent-attention", True), ("--kv-lora-rank", s.kv_lora_rank),
            ("--q-lora-rank", s.q_lora_rank or None), ("--qk-head-dim", s.head_dim),
            ("--qk-pos-emb-head-dim", s.rope_head_dim), ("--v-head-dim", s.v_head_dim)]


# --- the pipeline: stages, virtual stages, layout string, schedule
def _expand_layout(text: str, where: str) -> list[str]:
    """Megatron-LM's ``--pipeline-model-parallel-layout`` (``"E|(t|)*3,m|m||L"``): its stages, each a
    string of E (embedding), t (decoder layer), m (MTP), L (loss)."""
    s = text.replace(",", "").replace(" ", "")
    pat = re.compile(r"\(([^()]*)\)\*(\d+)|([EtmL])\*(\d+)")
    for _ in range(100):
        new = pat.sub(lambda m: (m[1] * int(m[2])) if m[1] is not None else m[3] * int(m[4]), s)
        if new == s:
            break
        s = new
    if not re.fullmatch(r"[EtmL|]*", s):
        raise _one_line(f"{where}: --pipeline-model-parallel-layout {text!r}: expected stages of E, t, m, L split by "
                        f"'|' (with (..)*n and x*n)")
    return s.split("|")


def _layout_partition(stages: list[str], layers: int, where: str) -> tuple[int, ...]:
    if any("m" in st for st in stages):
        raise _one_line(f"{where}: --pipeline-model-parallel-layout places MTP layers (m); pipetwin has no multi-token "
                        f"prediction")
    if not stages[0].startswith("E") or "".join(stages).count("E") != 1 or not stages[-1].endswith("L") \
            or "".join(stages).count("L") != 1:
        raise _one_line(f"{where}: --pipeline-model-parallel-layout must put the embedding (E) first on the first "
                        f"stage and the loss (L) last on the last, once each")
    counts = tuple(st.count("t") + st.count("E") + st.count("L") for st in stages)
    if sum(counts) != layers + 2:
        raise _one_line(f"{where}: --pipeline-model-parallel-layout places {sum(counts) - 2} decoder layers; "
                        f"--num-layers is {layers}")
    return counts


def _partition_layout(part: tuple[int, ...]) -> str:
    out = []
    for i, c in enumerate(part):
        t = c - (i == 0) - (i == len(part) - 1)
        body = "" if t == 0 else "t" if t == 1 else f"t*{t}"
        out.append(("E" if i == 0 else "") + body + ("L" if i == len(part) - 1 else ""))
    return "|".join(out)


def _mg_pipe_read(a: Args, out: dict):
    D = a.int("--pipeline-model-parallel-size", 1)
    L = out["model.layers"]
    layout = a.str("--pipeline-model-parallel-layout")
    per_vs, vs = a.int("--num-layers-per-virtual-pipeline-stage"), a.int("--num-virtual-stages-per-pipeline-rank")
    if per_vs is not None and vs is not None:
        raise _one_line(f"{a.where}: give --num-layers-per-virtual-pipeline-stage or "
                        f"--num-virtual-stages-per-pipeline-rank, not both")
    v = 1
    if per_vs is not None:
        if L % (per_vs * D):
            raise _one_line(f"{a.where}: --num-layers {L} is no multiple of --num-layers-per-virtual-pipeline-stage "
                            f"{per_vs} x --pipeline-model-parallel-size {D}")
        v = L // (per_vs * D)
    elif vs is not None:
        v = vs
    part = None
    if layout is not None:
        stages = _expand_layout(layout, a.where)
        if len(stages) % D:
            raise _one_line(f"{a.where}: --pipeline-model-parallel-layout has {len(stages)} stages, no multiple of "
                            f"--pipeline-model-parallel-size {D}")
        if (per_vs is not None or vs is not None) and len(stages) != D * v:
            raise _one_line(f"{a.where}: --pipeline-model-parallel-layout has {len(stages)} stages; the virtual "
                            f"stages give {D * v}")
        v = len(stages) // D
        part = _layout_partition(stages, L, a.where)
    for f in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
              "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"):
        if a.has(f):
            raise _one_line(f"{a.where}: {f} shapes the stage split; write it as --pipeline-model-parallel-layout "
                            f"(pipetwin reads the layout string)")
    from .partition import default_partition
    if part is not None and part == default_partition(L, D * v):
        part = None
    overlap = a.switch("--overlap-moe-expert-parallel-comm")
    out.update(devices=D, partition=part)
    if v > 1:
        out.update(schedule="interleaved", chunks=v, variant="a2a-overlap" if overlap else None)
    else:
        out.update(schedule="dapple", variant=None, overlap_fb=overlap)


def _mg_pipe_write(v: View):
    lay, L = v.layout, v.spec.layers
    D = lay.devices
    if lay.schedule_file is not None:
        raise _one_line(f"Megatron-LM runs its own schedules (1F1B, interleaved 1F1B), not a schedule file "
                        f"({Path(lay.schedule_file.path).name}); export --to torch-csv or torchtitan")
    if lay.stage_replicas is not None:
        raise _one_line("Megatron-LM replicates whole pipelines, not single stages (DAPPLE's stage replicas); nearest: "
                        "dapple with --dp")
    name = lay.schedule
    if D == 1 and lay.schedule_file is None:        # one device: no pipeline, whatever the order of its chunks
        note = [] if name == "dapple" else [(NOTE, f"{name} on one device runs as Megatron-LM's PP 1 (no virtual "
                                                    f"stages; imported back as dapple -D 1 and simulated as that)")]
        return [("--pipeline-model-parallel-size", 1)] + note
    if name not in MEGATRON_RUNS:
        near, why = NEAREST[name]
        raise _one_line(f"Megatron-LM cannot run {name}: {why}; nearest: --schedule {near}")
    v_ = lay.chunks if name == "interleaved" else 1
    if name == "interleaved" and v_ == 1:
        raise _one_line("interleaved with --chunks 1 is 1F1B: export --schedule dapple (Megatron-LM's 1F1B)")
    overlap = (name == "interleaved" and lay.variant == "a2a-overlap") or (name == "dapple" and v.parallel.overlap_fb)
    if (name == "interleaved" and v.parallel.overlap_fb and not overlap) or (name == "dapple" and overlap):
        raise _one_line("Megatron-LM overlaps F and B only in its combined 1F1B, with virtual stages when PP > 1: "
                        "nearest --schedule interleaved --variant a2a-overlap (not --overlap-fb)")
    if overlap and v.parallel.recompute == "full":
        raise _one_line("Megatron-LM's combined 1F1B (--overlap-moe-expert-parallel-comm) refuses full "
                        "recomputation: nearest --recompute selective")
    out = [("--pipeline-model-parallel-size", D)]
    from .partition import default_partition
    part = v.partition
    if part is not None and tuple(part) != default_partition(L, D * v_):
        if len(part) != D * v_:
            raise _one_line(f"--partition has {len(part)} stages; the schedule has {D * v_}")
        out.append(("--pipeline-model-parallel-layout", _partition_layout(tuple(part))))
    elif v_ > 1:
        out.append(("--num-layers-per-virtual-pipeline-stage", L // (D * v_)) if L % (D * v_) == 0
                   else ("--num-virtual-stages-per-pipeline-rank", v_))
    if overlap:
        out.append(("--overlap-moe-expert-parallel-comm", True))
    return out


# --- batch, data parallel, ZeRO
def _mg_batch_read(a: Args, out: dict):
    out["model.micro_batch"] = a.required_int("--micro-batch-size")
    out["_global"] = a.int("--global-batch-size")


def _mg_batch_write(v: View):
    return [("--micro-batch-size", v.spec.micro_batch), ("--global-batch-size", v.global_batch)]


def _mg_zero_read(a: Args, out: dict):
    dist = a.switch("--use-distributed-optimizer")
    mfsdp, tfsdp = a.switch("--use-megatron-fsdp"), a.switch("--use-torch-fsdp2")
    strategy = a.str("--data-parallel-sharding-strategy", "optim_grads_params")
    no_reshard = "--torch-fsdp2-no-reshard-after-forward" in a.values and a.switch(
        "--torch-fsdp2-no-reshard-after-forward")
    inst = a.int("--num-distributed-optimizer-instances", 1)
    if mfsdp and tfsdp:
        raise _one_line(f"{a.where}: --use-megatron-fsdp and --use-torch-fsdp2 are two FSDPs; keep one")
    zero, reshard = 0, False
    if mfsdp:
        zero = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}[strategy]
        reshard = zero == 3
    elif tfsdp:
        zero, reshard = 3, not no_reshard
    elif dist:
        zero = 1
    elif "--data-parallel-sharding-strategy" in a.values:
        out.setdefault("_unmodelled", []).append("--data-parallel-sharding-strategy without --use-megatron-fsdp "
                                                 "(no effect)")
    if no_reshard and not tfsdp:
        raise _one_line(f"{a.where}: --torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2")
    out.update(zero=zero, reshard_after_forward=reshard)
    if inst > 1:
        if zero != 1:
            raise _one_line(f"{a.where}: --num-distributed-optimizer-instances {inst} needs "
                            f"--use-distributed-optimizer alone")
        out["_instances"] = inst


def _mg_zero_write(v: View):
    p, R = v.parallel, v.layout.replicas
    if p.zero == 0:
        return []
    if p.zero == 1:
        inst = R // p.dp_shard if p.dp_shard else 1
        return [("--use-distributed-optimizer", True)] + \
            ([("--num-distributed-optimizer-instances", inst)] if inst > 1 else [])
    if p.dp_shard:
        raise _one_line(f"Megatron-LM's FSDP shards over all the data-parallel replicas here; --dp-shard {p.dp_shard} "
                        f"(HSDP) runs as --zero 1 with --dp-shard (its optimizer instances): nearest --dp-shard 0")
    if p.zero == 2:
        return [("--use-megatron-fsdp", True), ("--data-parallel-sharding-strategy", "optim_grads")]
    if p.reshard_after_forward:
        return [("--use-megatron-fsdp", True), ("--data-parallel-sharding-strategy", "optim_grads_params")]
    return [("--use-torch-fsdp2", True), ("--torch-fsdp2-no-reshard-after-forward", True)]


def _mg_recompute_read(a: Args, out: dict):
    gran = a.str("--recompute-granularity")
    if a.switch("--recompute-activations"):
        if gran not in (None, "selective"):
            raise _one_line(f"{a.where}: --recompute-activations is selective recomputation; "
                            f"--recompute-granularity says {gran}")
        gran = "selective"
    method, n = a.str("--recompute-method"), a.int("--recompute-num-layers")
    if gran not in (None, "full", "selective"):
        raise _one_line(f"{a.where}: --recompute-granularity must be full or selective; got {gran!r}")
    out["recompute"] = gran or "none"
    if gran == "full" and (method not in (None, "uniform") or (n or 1) != 1):
        out.setdefault("_unmodelled", []).append(f"--recompute-method {method} --recompute-num-layers {n} (priced as "
                                                 f"full recomputation of every block)")
    if gran == "selective" and a.has("--recompute-modules"):
        out.setdefault("_unmodelled", []).append("--recompute-modules (priced as the attention core's)")


def _mg_recompute_write(v: View):
    r = v.parallel.recompute
    if r == "none":
        return []
    if r == "selective":
        return [("--recompute-granularity", "selective")]
    return [("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]


def _mg_precision_read(a: Args, out: dict):
    bf16, fp16, fp8 = a.switch("--bf16"), a.switch("--fp16"), a.str("--fp8-format")
    if bf16 and fp16:
        raise _one_line(f"{a.where}: --bf16 and --fp16 are both given; keep one")
    if fp8 is not None and not (bf16 or fp16):
        raise _one_line(f"{a.where}: --fp8-format {fp8} runs the GEMMs in fp8 over bf16 or fp16 weights; add --bf16")
    if fp8 is not None:
        out["precision"] = "fp8"
        a.has("--fp8-recipe")
    else:
        out["precision"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    out["model.dtype_bytes"] = 2 if (bf16 or fp16) else 4


def _mg_precision_write(v: View):
    prec, d = v.precision, v.spec.dtype_bytes
    if prec == "fp8":
        return [("--bf16", True), ("--fp8-format", "hybrid")]
    if prec in ("bf16", "fp16"):
        if d != 2:
            raise _one_line(f"--precision {prec} on model {v.spec.name} of {d}-byte elements: Megatron-LM's --{prec} "
                            f"keeps 2-byte weights (give a 16-bit model)")
        return [(f"--{prec}", True)]
    if prec == "fp32" and d == 4:
        return []
    raise _one_line(f"Megatron-LM trains in fp32, bf16, fp16 or fp8; --precision {prec} on {d}-byte weights has no "
                    f"flag: nearest --precision {'fp32' if d == 4 else 'bf16'}")


def _mg_cp_read(a: Args, out: dict):
    out["cp"] = a.int("--context-parallel-size", 1)
    comm = a.get("--cp-comm-type", "p2p")
    comms = set(comm if isinstance(comm, list) else [comm])
    if comms <= {"p2p"}:
        out["cp_comm"] = "ring"
    elif comms == {"allgather"}:
        out["cp_comm"] = "allgather"
    else:
        out["cp_comm"] = "ring"
        out.setdefault("_unmodelled", []).append(f"--cp-comm-type {' '.join(sorted(comms))} (priced as p2p, a ring)")


def _mg_cp_write(v: View):
    p = v.parallel
    return [("--context-parallel-size", p.cp)] + \
        ([("--cp-comm-type", "allgather")] if p.cp > 1 and p.cp_comm == "allgather" else [])


def _mg_sp_read(a: Args, out: dict):
    sp = a.switch("--sequence-parallel")
    if sp and out["tp"] == 1:
        out.setdefault("_unmodelled", []).append("--sequence-parallel at TP 1 (Megatron-LM turns it off)")
        sp = False
    out["sequence_parallel"] = sp


def _mg_ep_read(a: Args, out: dict):
    out["ep"] = a.int("--expert-model-parallel-size", 1)


def _mg_ep_write(v: View):
    return [("--expert-model-parallel-size", v.parallel.ep)] if v.spec.is_moe or v.parallel.ep > 1 else []


MEGATRON: tuple[Row, ...] = (
    _model_int("--num-layers", "layers"),
    _model_int("--hidden-size", "hidden"),
    _model_int("--num-attention-heads", "heads"),
    Row(("--swiglu", "--normalization", "--position-embedding-type", "--disable-bias-linear", "--add-qkv-bias",
         "--qk-layernorm"), "ModelSpec.kind", _mg_kind_read, _mg_kind_write),
    Row(("--group-query-attention", "--num-query-groups", "--kv-channels"), "ModelSpec.kv_heads/head_size",
        _mg_heads_read, _mg_heads_write),
    Row(("--ffn-hidden-size",), "ModelSpec.ffn_hidden", _mg_ffn_read, _mg_ffn_write),
    Row(("--seq-length", "--max-position-embeddings"), "ModelSpec.seq_len", _mg_seq_read, _mg_seq_write),
    Row(("--untie-embeddings-and-output-weights",), "ModelSpec.tied_embeddings", _mg_tied_read, _mg_tied_write),
    Row(("--hidden-dropout", "--attention-dropout"), "ModelSpec.dropout", _mg_dropout_read, _mg_dropout_write),
    Row(("--attention-backend",), "ModelSpec.attention", _mg_attention_read, _mg_attention_write),
    Row(("--bf16", "--fp16", "--fp8-format"), "Parallel.precision, ModelSpec.dtype_bytes", _mg_precision_read,
        _mg_precision_write),
    _par_int("--tensor-model-parallel-size", "tp"),
    Row(("--sequence-parallel",), "Parallel.sequence_parallel", _mg_sp_read,
        lambda v: [("--sequence-parallel", True)] if v.parallel.sequence_parallel else []),
    _par_switch("--tp-comm-overlap", "tp_overlap"),
    Row(("--context-parallel-size", "--cp-comm-type"), "Parallel.cp, cp_comm", _mg_cp_read, _mg_cp_write),
    Row(("--expert-model-parallel-size",), "Parallel.ep", _mg_ep_read, _mg_ep_write),
    Row(("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
         "--moe-shared-expert-gate", "--moe-router-score-function", "--moe-layer-freq",
         "--moe-expert-capacity-factor", "--expert-tensor-parallel-size", "--moe-token-dispatcher-type",
         "--moe-enable-deepep", "--moe-flex-dispatcher-backend"),
        "ModelSpec.experts.., Parallel.etp, capacity_factor", _mg_moe_read, _mg_moe_write),
    Row(("--multi-latent-attention", "--kv-lora-rank", "--q-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
         "--v-head-dim"), "ModelSpec.kv_lora_rank..", _mg_mla_read, _mg_mla_write),
    Row(("--vocab-size", "--padded-vocab-size", "--make-vocab-size-divisible-by", "--tokenizer-type"),
        "ModelSpec.vocab", _mg_vocab_read, _mg_vocab_write),
    Row(("--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
         "--num-virtual-stages-per-pipeline-rank", "--pipeline-model-parallel-layout",
         "--overlap-moe-expert-parallel-comm"), "Layout.schedule, devices, chunks, variant; Job.partition",
        _mg_pipe_read, _mg_pipe_write),
    Row(("--micro-batch-size", "--global-batch-size"), "ModelSpec.micro_batch, Layout.microbatches",
        _mg_batch_read, _mg_batch_write),
    Row(("--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
         "--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward", "--num-distributed-optimizer-instances"),
        "Parallel.zero, reshard_after_forward, dp_shard", _mg_zero_read, _mg_zero_write),
    Row(("--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-activations"),
        "Parallel.recompute", _mg_recompute_read, _mg_recompute_write),
    # the data-parallel gradient reduction launched as the backward makes gradients (bucket by bucket),
    # behind compute: pipetwin's eager reduction in the bubbles; without it, after the last backward
    Row(("--overlap-grad-reduce",), "Job.eager", lambda a, out: out.update(eager=a.switch("--overlap-grad-reduce")),
        lambda v: [("--overlap-grad-reduce", True)] if v.eager else []),
)

# flags that change the cost of a run but that pipetwin does not model (listed, never dropped silently)
MEGATRON_UNMODELLED = (
    "--overlap-param-gather", "--overlap-param-gather-with-optimizer-step",
    "--moe-grouped-gemm",
    "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-router-num-groups", "--moe-router-group-topk",
    "--fp8-recipe", "--fp8-param-gather", "--delay-wgrad-compute", "--microbatch-group-size-per-virtual-pipeline-stage",
    "--window-size", "--no-gradient-accumulation-fusion", "--transformer-impl", "--attention-softmax-in-fp32",
    "--cpu-offloading", "--cuda-graph-impl", "--cuda-graph-scope", "--mtp-num-layers", "--no-overlap-p2p-communication",
    "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16", "--apply-layernorm-1p",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--openai-gelu", "--squared-relu", "--quick-geglu", "--hierarchical-context-parallel-sizes",
    "--num-layers-in-first-pipeline-stage", "--num-layers-in-last-pipeline-stage", "--rotary-percent",
    "--recompute-modules", "--fp8-dot-product-attention", "--use-flash-attn",
)


def read_megatron(text: str, where: str, *, replicas: int | None = None) -> Imported:
    """The job a Megatron-LM launch (a command line or a ``MODEL_ARGS`` YAML) describes
    (:data:`MEGATRON`). ``replicas``: the data-parallel R when the file does not give the GPUs
    (``--dp``: it wins over the file's GPU count). N = global / (micro x R)."""
    a = read_args(text, where)
    out: dict = {}
    for r in MEGATRON:
        r.read(a, out)
    unmodelled = list(out.pop("_unmodelled", []))
    gb, inst = out.pop("_global"), out.pop("_instances", 1)
    model = {k[6:]: v for k, v in list(out.items()) if k.startswith("model.")}
    for k in model:
        out.pop("model." + k)
    T, C, D = out["tp"], out["cp"], out["devices"]
    if replicas is None:
        world = _world(a)
        if world is None:
            raise _one_line(f"{where}: the file does not say how many GPUs train (torchrun --nproc-per-node and "
                            f"--nnodes, WORLD_SIZE, or the YAML's nodes and gpus): give --dp R")
        if world % (T * C * D):
            raise _one_line(f"{where}: {world} GPUs are no multiple of TP {T} x CP {C} x PP {D}")
        replicas = world // (T * C * D)
    mb = model["micro_batch"]
    gb = mb * replicas if gb is None else gb
    if gb % (mb * replicas):
        raise _one_line(f"{where}: --global-batch-size {gb} is no multiple of --micro-batch-size {mb} x DP {replicas}")
    out.update(replicas=replicas, microbatches=gb // (mb * replicas))
    if inst > 1:
        if replicas % inst:
            raise _one_line(f"{where}: --num-distributed-optimizer-instances {inst} does not divide DP {replicas}")
        out["dp_shard"] = replicas // inst
    model.setdefault("kv_heads", None)
    if model.get("kv_heads") == model["heads"]:
        model["kv_heads"] = None
    if model.get("head_size") is not None and model["head_size"] * model["heads"] == model["hidden"] \
            and not model.get("kv_lora_rank"):
        model["head_size"] = None
    if model["kind"] == "gpt" and model.get("kv_heads") is None:
        model.pop("kv_heads")
    spec = ModelSpec(name="megatron", **model)
    out["model"] = spec
    if not spec.is_moe:
        out.setdefault("etp", 1)
    gone = [f for f in a.left() if f in MEGATRON_UNMODELLED]
    unmodelled += gone
    ignored = [f for f in a.left() if f not in MEGATRON_UNMODELLED]
    return Imported(f"Megatron-LM arguments {where}", out, gb, tuple(unmodelled), tuple(ignored))


# the parallel record's fields each target has an argument for; the others (routing skew, fp8 dispatch,
# node-limited routing, the overlap's SM share) are what-ifs of the simulation: an export names them
MEGATRON_FIELDS = ("tp", "sequence_parallel", "tp_overlap", "zero", "dp_shard", "reshard_after_forward", "cp",
                   "cp_comm", "recompute", "micro_batch", "seq_len", "ep", "etp", "capacity_factor", "overlap_fb",
                   "precision", "a2a_hierarchical")
TORCHTITAN_FIELDS = ("tp", "sequence_parallel", "zero", "dp_shard", "reshard_after_forward", "cp", "recompute",
                     "micro_batch", "seq_len", "ep", "precision")


def what_ifs(view: View, covered: tuple[str, ...], target: str) -> list[str]:
    """The job's knobs ``target`` has no argument for, as notes."""
    from .parallel import option_name
    left = [f for f in view.parallel.changed() if f not in covered]
    return [f"{option_name(f)} {getattr(view.parallel, f)!r} is a what-if of the simulation; {target} has no "
            f"argument for it (not written)" for f in left]


def megatron_args(view: View) -> list[tuple[str, Any]]:
    """The Megatron-LM arguments of a job (:data:`MEGATRON`'s rows, in order)."""
    out = []
    for r in MEGATRON:
        out += [(f, val) for f, val in r.write(view) if val is not None]
    return out


def format_megatron(pairs: list[tuple[str, Any]], *, yaml: bool = False) -> str:
    """Megatron-LM arguments as a launch's lines (``\\`` continued) or a ``MODEL_ARGS`` YAML."""
    def val(v):
        return f"{v:g}" if isinstance(v, float) else str(v)
    if yaml:
        lines = ["MODEL_ARGS:"] + [f"  {f}: " + ("true" if v is True else repr(val(v)) if any(c in val(v) for c in
                                                                                            "|*[]()") else val(v))
                                   for f, v in pairs]
        return "\n".join(lines) + "\n"
    parts = [f if v is True else f"{f} {shlex.quote(val(v))}" for f, v in pairs]
    return " \\\n".join(parts) + "\n"


# ============================================================================ torchtitan: the table
def _tt_split(L: int, S: int, first: int, last: int) -> tuple[int, ...] | None:
    """torchtitan's split of L blocks into S stages, the embedding weighing ``first`` layers and the
    head ``last`` (``generate_llm_fqn_per_model_part``), as pipetwin's partition (layer counts with
    the embedding and the head one each); None where torchtitan refuses it."""
    if S == 1:
        return (L + 2,)
    eff = L + first + last
    q, extra = divmod(eff, S)
    if q == 0 or first > q or last > q or S > eff:
        return None
    eff_counts = [q + 1 if i < extra else q for i in range(S)]
    blocks = list(eff_counts)
    blocks[0] -= first
    blocks[-1] -= last
    if any(b < 0 for b in blocks):
        return None
    return tuple(b + (i == 0) + (i == S - 1) for i, b in enumerate(blocks))


def _tt_stages(L: int, D: int, per: int | None, first: int, last: int, looped: bool) -> int:
    if per is None:
        return D * (2 if looped else 1)
    return math.ceil((L + first + last) / per)


def _tt_pipe_read(a: Args, out: dict, L: int):
    D = a.int("--parallelism.pipeline_parallel_degree", 1)
    csv = a.str("--parallelism.pipeline_parallel_schedule_csv")
    name = a.str("--parallelism.pipeline_parallel_schedule", "1F1B")
    per = a.int("--parallelism.pipeline_parallel_layers_per_stage")
    first = a.int("--parallelism.pipeline_parallel_first_stage_less_layers", 1)
    last = a.int("--parallelism.pipeline_parallel_last_stage_less_layers", 1)
    out["devices"] = D
    if csv:
        from .files import load_schedule_file
        path = Path(csv)
        if not path.is_absolute():
            path = Path(a.where).parent / path
        sf = load_schedule_file(str(path))
        if sf.schedule.num_devices != D:
            raise _one_line(f"{a.where}: pipeline_parallel_schedule_csv {csv} has {sf.schedule.num_devices} ranks; "
                            f"pipeline_parallel_degree is {D}")
        out.update(schedule=sf.name, schedule_file=sf, chunks=sf.chunks)
        S = sf.schedule.num_stages
    else:
        fam = {v: k for k, v in TORCH_NAMES.items()}.get(name)
        if D == 1:          # no pipeline: torchtitan ignores the schedule
            fam, name = "dapple", "1F1B"
        if fam is None:
            raise _one_line(f"{a.where}: pipeline_parallel_schedule {name!r}: pipetwin reads "
                            f"{', '.join(TORCH_NAMES.values())} (or a pipeline_parallel_schedule_csv)")
        looped = fam in ("interleaved", "zb-v", "dualpipe-v")
        S = _tt_stages(L, D, per, first, last, looped) if D > 1 else 1
        if S % D:
            raise _one_line(f"{a.where}: {S} stages over pipeline_parallel_degree {D}: torchtitan needs a multiple")
        v = S // D
        if looped and v < 2 or not looped and v != 1:
            raise _one_line(f"{a.where}: {name} runs {'2 or more stages' if looped else 'one stage'} per rank; the "
                            f"layers per stage give {v}")
        if fam in ("zb-v", "dualpipe-v") and v != 2:
            raise _one_line(f"{a.where}: {name} runs 2 stages per rank (a V); the layers per stage give {v}")
        out.update(schedule=fam, **({"chunks": v} if fam == "interleaved" else {}))
    from .partition import default_partition
    part = _tt_split(L, S, first, last) if D > 1 else None
    if D > 1 and part is None:
        raise _one_line(f"{a.where}: torchtitan cannot split {L} layers into {S} stages with first/last stage "
                        f"less layers {first}/{last}")
    out["partition"] = None if part is None or part == default_partition(L, S) else part


def _tt_pipe_write(v: View):
    lay, L = v.layout, v.spec.layers
    D = lay.devices
    if lay.stage_replicas is not None:
        raise _one_line("torchtitan replicates whole pipelines, not single stages (DAPPLE's stage replicas); nearest: "
                        "dapple with --dp")
    out = [("--parallelism.pipeline_parallel_degree", D)]
    if D == 1:
        return out
    sched = _compute_schedule(v)
    S = sched.num_stages
    from .partition import default_partition
    part = tuple(v.partition) if v.partition is not None else default_partition(L, S)
    name = None if lay.schedule_file is not None else TORCH_NAMES.get(lay.schedule)
    if lay.schedule == "interleaved" and lay.variant not in (None, "megatron"):
        name = None
    looped = S > D
    found = None
    for first in range(0, L + 1):
        for last in range(0, L + 1):
            if _tt_split(L, S, first, last) != part:
                continue
            per = None if S == D * (2 if looped else 1) else next(
                (p for p in range(1, L + 3) if _tt_stages(L, D, p, first, last, looped) == S), False)
            if per is not False:
                found = (first, last, per)
                break
        if found:
            break
    if found is None:
        near = _tt_split(L, S, 1, 1)
        raise _one_line(f"torchtitan splits {L} layers into {S} stages evenly (the embedding and the head weighing "
                        f"pipeline_parallel_first/last_stage_less_layers): it cannot place --partition "
                        f"{','.join(map(str, part))}; nearest: --partition {','.join(map(str, near or ()))}")
    first, last, per = found
    if name is not None:
        out.append(("--parallelism.pipeline_parallel_schedule", name))
    else:
        out.append(("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B" if looped else "1F1B"))
        out.append(("--parallelism.pipeline_parallel_schedule_csv", CSV_BESIDE))
    if per is not None:
        out.append(("--parallelism.pipeline_parallel_layers_per_stage", per))
    out += [("--parallelism.pipeline_parallel_first_stage_less_layers", first),
            ("--parallelism.pipeline_parallel_last_stage_less_layers", last)]
    return out


CSV_BESIDE = "<the schedule's CSV>"      # replaced by the file written beside --out
NOTE = "#note"          # a row's remark on what the target makes of the job (Export.notes, not an argument)


def _tt_dp_read(a: Args, out: dict, world: int | None, replicas: int | None):
    rep = a.int("--parallelism.data_parallel_replicate_degree", 1)
    shard = a.int("--parallelism.data_parallel_shard_degree", -1)
    T, C, D = out["tp"], out["cp"], out["devices"]
    if shard == -1:
        if replicas is not None:
            if replicas % rep:
                raise _one_line(f"{a.where}: --dp {replicas} is no multiple of data_parallel_replicate_degree {rep}")
            shard = replicas // rep
        elif world is not None:
            if world % (rep * T * C * D):
                raise _one_line(f"{a.where}: {world} GPUs are no multiple of replicate {rep} x TP {T} x CP {C} x "
                                f"PP {D}")
            shard = world // (rep * T * C * D)
        else:
            raise _one_line(f"{a.where}: data_parallel_shard_degree -1 takes the GPUs left: say how many (NGPU=, "
                            f"torchrun --nproc_per_node) or give --dp R")
    R = rep * shard
    if replicas is not None and replicas != R:
        raise _one_line(f"{a.where}: --dp {replicas} disagrees with replicate {rep} x shard {shard} = {R}")
    policy = a.str("--parallelism.fsdp_reshard_after_forward", "default")
    if policy not in ("default", "always", "never"):
        raise _one_line(f"{a.where}: fsdp_reshard_after_forward must be default, always or never; got {policy!r}")
    out["replicas"] = R
    if shard > 1:
        out.update(zero=3, dp_shard=shard if rep > 1 else 0,
                   reshard_after_forward={"always": True, "never": False}.get(policy, D == 1))
    else:
        out.update(zero=0, dp_shard=0, reshard_after_forward=False)


def _tt_dp_write(v: View):
    p, R = v.parallel, v.layout.replicas
    if p.zero in (1, 2):
        raise _one_line(f"torchtitan shards with FSDP2 (ZeRO-3: weights, gradients and optimizer state); --zero "
                        f"{p.zero} has no setting there: nearest --zero 3")
    if p.zero == 0:
        return [("--parallelism.data_parallel_replicate_degree", R), ("--parallelism.data_parallel_shard_degree", 1)]
    shard = p.dp_shard or R
    return [("--parallelism.data_parallel_replicate_degree", R // shard),
            ("--parallelism.data_parallel_shard_degree", shard),
            ("--parallelism.fsdp_reshard_after_forward", "always" if p.reshard_after_forward else "never")]


def _tt_batch_read(a: Args, out: dict, spec: ModelSpec):
    s = a.int("--training.max_context_length", 2048)
    tokens = a.int("--training.num_tokens_per_microbatch_per_dp_rank", 16384)
    if tokens % s:
        raise _one_line(f"{a.where}: num_tokens_per_microbatch_per_dp_rank {tokens} is no multiple of "
                        f"max_context_length {s} (whole sequences per micro-batch)")
    N = a.int("--parallelism.num_pp_microbatches", 1) if out["devices"] > 1 else 1
    step = a.int("--training.num_tokens_per_train_step", -1)
    R = out["replicas"]
    if step != -1:
        if step % (tokens * R):
            raise _one_line(f"{a.where}: num_tokens_per_train_step {step} is no multiple of the micro-batch's "
                            f"{tokens} tokens x DP {R}")
        acc = step // (tokens * R)
        if out["devices"] == 1:
            N = acc
        elif acc != N:
            raise _one_line(f"{a.where}: num_tokens_per_train_step {step} makes {acc} micro-batches per DP rank; "
                            f"num_pp_microbatches is {N} (gradient accumulation over pipeline runs is not modelled: "
                            f"set num_pp_microbatches {acc})")
    out.update(seq_len=s, micro_batch=tokens // s, microbatches=N)


def _tt_batch_write(v: View):
    s, b = v.spec.seq_len, v.spec.micro_batch
    out = [("--training.max_context_length", s), ("--training.num_tokens_per_microbatch_per_dp_rank", s * b)]
    if v.layout.devices > 1:
        out.append(("--parallelism.num_pp_microbatches", v.layout.microbatches))
    out.append(("--training.num_tokens_per_train_step", s * b * v.layout.microbatches * v.layout.replicas))
    return out


def _tt_ac_read(a: Args, out: dict):
    modes = [t.split(":", 1)[1] for t in a.extra if t.replace("-", "_").startswith("activation_checkpoint:")]
    if len(set(modes)) > 1:
        raise _one_line(f"{a.where}: activation-checkpoint is given as {' and '.join(modes)}; keep one")
    mode = modes[0] if modes else "selective"
    if mode not in ("none", "selective", "full", "memory-budget"):
        raise _one_line(f"{a.where}: activation-checkpoint:{mode}: expected none, selective, full or memory-budget")
    if mode == "memory-budget":
        out.setdefault("_unmodelled", []).append("activation-checkpoint:memory-budget (priced as selective)")
        mode = "selective"
    a.extra = [t for t in a.extra if not t.replace("-", "_").startswith("activation_checkpoint:")]
    out["recompute"] = mode


def _tt_precision_read(a: Args, out: dict):
    dtype = a.str("--training.dtype", "float32")
    mp = a.str("--training.mixed_precision_param", "bfloat16")
    out["precision"] = "bf16" if dtype == "bfloat16" or mp == "bfloat16" else "fp32"
    if dtype == "bfloat16":
        out.setdefault("_unmodelled", []).append("--training.dtype bfloat16 (no fp32 master weights: state priced as "
                                                 "mixed precision's)")
    a.has("--training.mixed_precision_reduce")


def _tt_precision_write(v: View):
    prec = v.precision
    if prec == "fp8":
        raise _one_line("torchtitan sets float8 in its recipe (Float8LinearConverter), not by a command-line "
                        "override; nearest: --precision bf16 (then add float8 to the recipe)")
    if prec not in ("bf16", "fp32"):
        raise _one_line(f"torchtitan trains in bfloat16 or float32; --precision {prec}: nearest --precision bf16")
    return [("--training.mixed_precision_param", "bfloat16" if prec == "bf16" else "float32")]


def _tt_sp_write(v: View):
    p = v.parallel
    if p.tp == 1:
        return []
    return [("--parallelism.enable_sequence_parallel" if p.sequence_parallel
             else "--parallelism.no_enable_sequence_parallel", True)]


TORCHTITAN: tuple[tuple[str, str, Callable], ...] = (
    # (flags, field, write); the reads are read_torchtitan's, in the same order
    ("--parallelism.tensor_parallel_degree", "Parallel.tp",
     lambda v: [("--parallelism.tensor_parallel_degree", v.parallel.tp)]),
    ("--parallelism.enable_sequence_parallel", "Parallel.sequence_parallel", _tt_sp_write),
    ("--parallelism.context_parallel_degree", "Parallel.cp",
     lambda v: [("--parallelism.context_parallel_degree", v.parallel.cp)]),
    ("--parallelism.expert_parallel_degree", "Parallel.ep",
     lambda v: [("--parallelism.expert_parallel_degree", v.parallel.ep)] if v.spec.is_moe else []),
    ("--parallelism.pipeline_parallel_*", "Layout.schedule, devices, chunks; Job.partition", _tt_pipe_write),
    ("--parallelism.data_parallel_replicate_degree, _shard_degree, fsdp_reshard_after_forward",
     "Layout.replicas, Parallel.zero, dp_shard, reshard_after_forward", _tt_dp_write),
    ("--training.max_context_length, num_tokens_per_microbatch_per_dp_rank, num_tokens_per_train_step, "
     "--parallelism.num_pp_microbatches", "Parallel.seq_len, micro_batch, Layout.microbatches", _tt_batch_write),
    ("activation-checkpoint:none|selective|full", "Parallel.recompute",
     lambda v: [(f"activation-checkpoint:{v.parallel.recompute}", True)]),
    ("--training.mixed_precision_param, --training.dtype", "Parallel.precision", _tt_precision_write),
)


def read_torchtitan(text: str, where: str, model, *, replicas: int | None = None) -> Imported:
    """The job a file of torchtitan overrides describes (its model: ``model``, a pipetwin model
    name or spec, since torchtitan's recipe holds the model)."""
    from .model_spec import load_model
    a = read_args(text, where)
    a.used.update({"--module", "--config"})
    spec = model if isinstance(model, ModelSpec) else load_model(model)
    out: dict = {}
    out["tp"] = a.int("--parallelism.tensor_parallel_degree", 1)
    sp = a.switch("--parallelism.enable_sequence_parallel") if "--parallelism.enable_sequence_parallel" in a.values \
        else not a.switch("--parallelism.no_enable_sequence_parallel")
    out["sequence_parallel"] = sp and out["tp"] > 1
    out["cp"] = a.int("--parallelism.context_parallel_degree", 1)
    ep = a.int("--parallelism.expert_parallel_degree", 1)
    if spec.is_moe:
        out["ep"] = ep
    _tt_pipe_read(a, out, spec.layers)
    _tt_dp_read(a, out, _world(a), replicas)
    _tt_batch_read(a, out, spec)
    _tt_ac_read(a, out)
    _tt_precision_read(a, out)
    unmodelled = list(out.pop("_unmodelled", []))
    if a.extra:
        unmodelled += [f"{t} (not read)" for t in a.extra]
    left = a.left()
    unmod = [f for f in left if f.startswith(("--compile.", "--parallelism.", "--training.enable_cpu_offload",
                                              "--activation_checkpoint."))]
    unmodelled += unmod
    ignored = [f for f in left if f not in unmod]
    out["model"] = spec
    gb = out["micro_batch"] * out["microbatches"] * out["replicas"]
    return Imported(f"torchtitan overrides {where}", out, gb, tuple(unmodelled), tuple(ignored))


def torchtitan_args(view: View) -> list[tuple[str, Any]]:
    out = []
    for _, _, write in TORCHTITAN:
        out += [(f, val) for f, val in write(view) if val is not None]
    return out


def format_torchtitan(pairs, model_name: str) -> str:
    head = f"# torchtitan overrides for {model_name} (the model is your --module/--config recipe's)\n"
    return head + " \\\n".join(f if v is True else f"{f} {shlex.quote(str(v))}" for f, v in pairs) + "\n"


# ============================================================================ torch.distributed.pipelining CSV
def _compute_schedule(view: View):
    """The job's compute-only schedule (a schedule file's own)."""
    lay = view.layout
    if lay.schedule_file is not None:
        return lay.schedule_file.schedule
    from schedules import build
    if lay.stage_replicas is not None:
        from schedules.dapple_replicated import replicated_schedule, sub_batches
        return replicated_schedule(lay.stage_replicas, lay.microbatches // sub_batches(lay.stage_replicas))
    return build(lay.schedule, lay.devices, lay.microbatches, **lay.family_options(), **(view.family or {}))


def torch_csv(view: View) -> str:
    """The job's schedule as torch.distributed.pipelining's CSV (:func:`schedules.io.export_text`);
    a schedule of two model copies is refused naming the nearest single-copy one."""
    from schedules.io import export_text
    sched = _compute_schedule(view)
    refusal = single_copy_refusal(sched)
    if refusal:
        raise _one_line(refusal)
    return export_text(sched, "torch-csv")


# ============================================================================ export
@dataclass(frozen=True)
class Export:
    """What an export writes: ``text`` (to standard output or ``--out``), ``files`` written beside it
    (path -> text: torchtitan's schedule CSV), ``notes`` (what the target sets itself)."""

    text: str
    files: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def export_job(job, target: str, out: str | None = None) -> Export:
    """``job`` for ``target`` (:data:`TARGETS`); ``out``: where the text goes (torchtitan's CSV for a
    schedule without a torch name is written beside it, ``OUT.schedule.csv``; without ``out`` such a
    schedule is refused)."""
    if target not in TARGETS:
        raise _one_line(f"--to must be one of {', '.join(TARGETS)}; got {target!r}")
    view = job_view(job)
    if target == "torch-csv":
        return Export(torch_csv(view))
    if target == "megatron":
        yaml = out is not None and str(out).lower().endswith((".yaml", ".yml"))
        pairs = megatron_args(view)
        notes = tuple(v for f, v in pairs if f == NOTE) + tuple(what_ifs(view, MEGATRON_FIELDS, "Megatron-LM"))
        return Export(format_megatron([(f, v) for f, v in pairs if f != NOTE], yaml=yaml), notes=notes)
    if view.layout.schedule_file is None and view.layout.schedule in TWO_COPIES:
        near = NEAREST_SINGLE_COPY[view.layout.schedule]
        raise _one_line(f"torchtitan cannot run {view.layout.schedule}: it runs one model copy per pipeline (no "
                        f"bidirectional pipelines); nearest: --schedule {near}")
    pairs = torchtitan_args(view)
    files = {}
    if any(f == "--parallelism.pipeline_parallel_schedule_csv" for f, _ in pairs):
        if out is None:
            name = view.layout.schedule if view.layout.schedule_file is None else "a schedule file"
            raise _one_line(f"torchtitan has no schedule named {name}: it runs it from a CSV written beside the "
                            f"overrides; give --out FILE")
        csv = str(Path(out).with_suffix("")) + ".schedule.csv"
        files[csv] = torch_csv(view)
        pairs = [(f, csv if v == CSV_BESIDE else v) for f, v in pairs]
    return Export(format_torchtitan(pairs, view.spec.name), files,
                  tuple(what_ifs(view, TORCHTITAN_FIELDS, "torchtitan")))


def canonical_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the fields an import sets explicitly (for comparing records)."""
    return replace(spec, tied_embeddings=spec.tied, dropout=spec.has_dropout, attention=spec.attention_kind,
                   ffn_hidden=spec.ffn)
