"""Model specs: the sizes of a GPT-style decoder (and of other layer stacks the papers use).

A spec is what both the executor (to build the real model) and the cost models (to compute
FLOPs and bytes, see :mod:`cost_models.transformer`) read. Presets ship as YAML files under
``cost_models/presets/models``; a user passes a preset name or a path to their own YAML file.

Fields: ``layers`` transformer blocks (embedding and output head come on top), ``hidden`` h,
``heads`` a, ``seq_len`` s, ``vocab`` V, ``micro_batch`` b (sequences per micro-batch),
``ffn_mult`` (MLP width = ffn_mult * h), ``kind`` gpt | bert | llama, ``dtype_bytes`` (bytes per
activation / weight element: 2 for fp16/bf16, 4 for fp32), and the fields that default by kind:

* ``kv_heads`` (grouped-query attention: heads sharing one key/value head; default ``heads``; gpt and
  llama kinds: a Megatron-LM GPT with ``--num-query-groups`` and a GeLU MLP is a gpt block with it),
* ``ffn_hidden`` (the MLP's inner size, when it is no multiple of h: Llama's SwiGLU 14336 for
  h 4096; default ``ffn_mult * hidden``),
* ``tied_embeddings`` (the output head reuses the token table, counted once in the model's size:
  gpt yes; bert and llama no, as their papers count them),
* ``dropout`` (dropout layers and their 1-byte masks: gpt and bert yes, llama no),
* ``attention``: ``eager`` (the score matrix is materialised: kept for the backward and moved
  through memory, as in the Megatron-LM and Korthikanti measurements: gpt and bert) or
  ``flash`` (a fused kernel keeping only its output and the row statistics: llama, and every
  Hugging Face config). Time and memory both follow it.

Mixture-of-experts and attention-slot fields (llama kind only; all default to a dense block):

* ``head_size`` (the width of one attention head when it is no ``hidden / heads``: Qwen3's 128;
  with MLA the non-rotary query/key head size), ``qk_norm`` (Qwen3's RMSNorm of each query and key
  head),
* ``experts`` E routed experts per MoE block (0: dense), ``top_k`` k experts per token,
  ``expert_ffn`` each routed expert's SwiGLU inner size (default ``ffn``), ``shared_ffn`` the
  inner size of the shared expert(s) every token passes (DeepSeek-V3: 1 x 2048; 0: none),
  ``shared_gate`` (Qwen2-MoE's sigmoid gate on the shared expert), ``dense_layers`` the first
  blocks whose MLP is dense (``ffn`` wide; DeepSeek-V3: 3), ``router`` softmax | sigmoid scores
  (sigmoid carries DeepSeek's per-expert bias), ``aux_loss_coeff`` the weight of the load-balancing
  auxiliary loss the executor adds to the training loss (:mod:`executor.moe`; 0: off; the cost
  models do not read it: its FLOPs are the router's E per token),
* multi-head latent attention (DeepSeek): ``kv_lora_rank`` > 0 turns it on, with
  ``q_lora_rank`` (0: a full query projection), ``rope_head_dim`` (the decoupled rotary part of
  each query/key head) and ``v_head_size`` (default ``head_size``).

The kinds: ``gpt`` (pre-LayerNorm, GeLU MLP of two matrices, learned positions, biases), ``bert``
(post-LayerNorm encoder, token types), ``llama`` (RMSNorm, SwiGLU MLP of three matrices, rotary
positions: no position table, no biases). Mistral and Qwen2 configs are llama blocks (Qwen2 adds
biases to Q, K and V).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ._spec import SpecError, known_fields, presets, read_yaml
from .hf_config import hf_fields, is_hf_config
from .stack import is_model_ref, model_ref_help

KINDS = ("gpt", "bert", "llama")
ATTENTION = ("eager", "flash")
ROUTERS = ("softmax", "sigmoid")
# the fields of a mixture-of-experts or multi-head-latent-attention block (llama kind only)
MOE_FIELDS = ("experts", "top_k", "expert_ffn", "shared_ffn", "shared_gate", "dense_layers", "router",
              "aux_loss_coeff")
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "rope_head_dim", "v_head_size")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int                 # transformer blocks
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    micro_batch: int = 1
    ffn_mult: int = 4
    kind: str = "gpt"           # gpt | bert (encoder, same block cost) | llama
    dtype_bytes: int = 2        # activations/weights in fp16/bf16 for cost models
    kv_heads: int | None = None         # None: heads (no grouped-query attention)
    ffn_hidden: int | None = None       # None: ffn_mult * hidden
    tied_embeddings: bool | None = None  # None: by kind
    dropout: bool | None = None         # None: by kind
    attention: str | None = None        # eager | flash; None: by kind
    qkv_bias: bool = False              # llama kind only: biases on Q, K, V (Qwen2)
    head_size: int | None = None        # None: hidden / heads
    qk_norm: bool = False               # RMSNorm of each query and key head (Qwen3)
    experts: int = 0                    # routed experts per MoE block; 0: a dense model
    top_k: int = 0                      # experts per token (required with experts)
    expert_ffn: int | None = None       # a routed expert's inner size; None: ffn
    shared_ffn: int = 0                 # inner size of the shared expert(s); 0: none
    shared_gate: bool = False           # a sigmoid gate on the shared expert (Qwen2-MoE)
    dense_layers: int = 0               # the first blocks keep a dense MLP (DeepSeek-V3: 3)
    router: str = "softmax"             # softmax | sigmoid scores
    kv_lora_rank: int = 0               # > 0: multi-head latent attention (DeepSeek)
    q_lora_rank: int = 0                # MLA: the query's low rank; 0: a full query projection
    rope_head_dim: int = 0              # MLA: the decoupled rotary part of a query/key head
    v_head_size: int | None = None      # MLA: a value head's size; None: head_size
    aux_loss_coeff: float = 0.0         # the load-balancing loss's weight in the training loss (executor); 0: off

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "seq_len", "vocab", "micro_batch", "ffn_mult", "dtype_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"model {self.name!r}: field {f!r} must be a positive integer; got {v!r}")
        if self.head_size is None and self.hidden % self.heads:
            raise SpecError(f"model {self.name!r}: field 'heads': hidden ({self.hidden}) must be divisible "
                            f"by heads ({self.heads}), or give head_size")
        if self.kind not in KINDS:
            raise SpecError(f"model {self.name!r}: field 'kind' must be one of {', '.join(KINDS)}; got {self.kind!r}")
        for f in ("kv_heads", "ffn_hidden", "head_size", "expert_ffn", "v_head_size"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SpecError(f"model {self.name!r}: field {f!r} must be a positive integer; got {v!r}")
        if self.heads % self.kv:
            raise SpecError(f"model {self.name!r}: field 'kv_heads': heads ({self.heads}) must be a multiple of "
                            f"kv_heads ({self.kv})")
        for f in ("shared_ffn", "dense_layers", "experts", "top_k", "kv_lora_rank", "q_lora_rank", "rope_head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SpecError(f"model {self.name!r}: field {f!r} must be an integer >= 0; got {v!r}")
        for f in ("tied_embeddings", "dropout", "qkv_bias", "qk_norm", "shared_gate"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, bool):
                raise SpecError(f"model {self.name!r}: field {f!r} must be true or false; got {v!r}")
        if self.attention is not None and self.attention not in ATTENTION:
            raise SpecError(f"model {self.name!r}: field 'attention' must be one of {', '.join(ATTENTION)}; "
                            f"got {self.attention!r}")
        if (self.kind == "bert" and self.kv != self.heads) or (self.kind != "llama" and self.qkv_bias):
            what = "grouped-query attention (kv_heads)" if self.kind == "bert" and self.kv != self.heads else "qkv_bias"
            raise SpecError(f"model {self.name!r}: {what} is a decoder's field (a gpt block takes kv_heads, a llama "
                            f"block both); set kind: gpt or llama")
        c = self.aux_loss_coeff
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise SpecError(f"model {self.name!r}: field 'aux_loss_coeff' must be a finite number >= 0; got {c!r}")
        if self.router not in ROUTERS:
            raise SpecError(f"model {self.name!r}: field 'router' must be one of {', '.join(ROUTERS)}; "
                            f"got {self.router!r}")
        dense = ModelSpec.__dataclass_fields__
        given = [f for f in MOE_FIELDS + MLA_FIELDS + ("head_size", "qk_norm")
                 if getattr(self, f) != dense[f].default]
        if self.kind != "llama" and given:
            raise SpecError(f"model {self.name!r}: field {given[0]!r} belongs to a llama-kind block (mixture of "
                            f"experts, latent attention, head size); set kind: llama")
        if self.experts:
            if not 1 <= self.top_k <= self.experts:
                raise SpecError(f"model {self.name!r}: field 'top_k' must be 1..experts ({self.experts}) with "
                                f"routed experts; got {self.top_k!r}")
            if self.dense_layers >= self.layers:
                raise SpecError(f"model {self.name!r}: field 'dense_layers' ({self.dense_layers}) leaves no MoE "
                                f"block of {self.layers}; give fewer, or experts: 0")
        else:
            moe = [f for f in MOE_FIELDS if f != "experts" and getattr(self, f) != dense[f].default]
            if moe:
                raise SpecError(f"model {self.name!r}: field {moe[0]!r} needs routed experts; give experts > 0")
        if not self.kv_lora_rank:
            mla = [f for f in MLA_FIELDS if getattr(self, f) != dense[f].default]
            if mla:
                raise SpecError(f"model {self.name!r}: field {mla[0]!r} is multi-head latent attention's; "
                                f"give kv_lora_rank > 0")

    # ---------------------------------------------------------------- fields by kind
    @property
    def kv(self) -> int:
        """Key/value heads (grouped-query attention; = heads without it)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn(self) -> int:
        """The MLP's inner size."""
        return self.ffn_mult * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def head_dim(self) -> int:
        """The width of one query/key head (with MLA: its non-rotary part)."""
        return self.hidden // self.heads if self.head_size is None else self.head_size

    @property
    def v_head_dim(self) -> int:
        """The width of one value head."""
        return self.head_dim if self.v_head_size is None else self.v_head_size

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def beyond_dense(self) -> tuple[str, ...]:
        """What the block has beyond a dense block of ``hidden / heads`` wide heads, in words:
        experts, latent attention, another head size, q/k norms (empty for a plain block): what the
        kernel cost model does not price (:func:`cost_models.kernels.unpriced`)."""
        out = ("experts",) if self.is_moe else ()
        out += ("latent attention",) if self.is_mla else ()
        if self.head_dim * self.heads != self.hidden:
            out += (f"heads of {self.head_dim} (not hidden / heads = {self.hidden / self.heads:g})",)
        return out + (("query/key norms",) if self.qk_norm else ())

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts (the last ``layers - dense_layers``)."""
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def expert_width(self) -> int:
        """A routed expert's inner size."""
        return self.ffn if self.expert_ffn is None else self.expert_ffn

    @property
    def tied(self) -> bool:
        return self.kind == "gpt" if self.tied_embeddings is None else self.tied_embeddings

    @property
    def has_dropout(self) -> bool:
        return self.kind != "llama" if self.dropout is None else self.dropout

    @property
    def attention_kind(self) -> str:
        return ("flash" if self.kind == "llama" else "eager") if self.attention is None else self.attention

    def check_tensor_parallel(self, tp: int, option: str = "--tp", sequence_parallel: bool = False) -> None:
        """Refuse a tensor-parallel size that does not split the heads, the key/value heads, the
        MLP's inner size and, with sequence parallelism, the sequence evenly (one line naming the
        first that does not)."""
        parts = (("heads", self.heads), ("kv_heads", self.kv), ("the FFN size", self.ffn))
        if sequence_parallel:
            parts += (("the sequence length (--sequence-parallel)", self.seq_len),)
        for what, n in parts:
            if n % tp:
                raise ValueError(f"{option} {tp} does not divide {what} ({n}) of model {self.name}; "
                                 f"pick a {option} that divides {n}")

    def check_context_parallel(self, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
        """Refuse a context-parallel size C the formulas cannot price (one line): the sequence must
        split into 2C equal chunks (causal load balance: chunks i and 2C-1-i on CP rank i), and with
        sequence parallelism each GPU's s/C tokens into T; latent attention (its compressed K/V
        exchange) is not priced with CP. A mixture of experts is: each GPU routes its s/C tokens,
        the experts fold over T x C x R (:mod:`cost_models.moe`)."""
        if cp == 1:
            return
        if self.is_mla:
            raise ValueError(f"--cp {cp}: context parallelism is priced for multi-head attention; model {self.name} "
                             f"has latent attention (MLA), whose compressed K/V exchange is not (drop --cp)")
        if self.seq_len % (2 * cp):
            raise ValueError(f"--cp {cp} needs the sequence length ({self.seq_len}) divisible by 2 x {cp} = {2 * cp} "
                             f"(2C chunks for causal load balance); pick a --cp or --seq-len that splits it")
        if sequence_parallel and (self.seq_len // cp) % tp:
            raise ValueError(f"--cp {cp} with --sequence-parallel needs each GPU's {self.seq_len // cp} tokens "
                             f"divisible by --tp {tp}; pick a --cp or --seq-len that splits them")

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> "ModelSpec":
        """A copy with some fields changed (e.g. ``micro_batch=4``), validated again."""
        return dataclasses.replace(self, **changes)


def model_presets() -> list[str]:
    return presets("models")


def spec_from_dict(d: dict, source: str = "<dict>") -> ModelSpec:
    if not isinstance(d, dict):
        raise SpecError(f"{source}: expected a mapping of model fields")
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise SpecError(f"{source}: unknown field {unknown[0]!r} ({known_fields(str(unknown[0]), known)})")
    for f in ("layers", "hidden", "heads", "seq_len", "vocab"):
        if f not in d:
            raise SpecError(f"{source}: missing field {f!r}")
    d = dict(d)
    d.setdefault("name", Path(source).stem)
    try:
        return ModelSpec(**d)
    except SpecError as e:
        raise SpecError(f"{source}: {e}") from None
    except TypeError as e:  # pragma: no cover - defensive
        raise SpecError(f"{source}: {e}") from None


def spec_from_hf_config(path, seq_len: int | None = None, micro_batch: int = 1) -> ModelSpec:
    """The spec of a Hugging Face ``config.json`` (:mod:`cost_models.hf_config`)."""
    fields = hf_fields(path, seq_len, micro_batch)
    try:
        return ModelSpec(**fields)
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name (see :func:`model_presets`), a path to a YAML file or to a Hugging Face
    ``config.json`` (:mod:`cost_models.hf_config`). (A Python model file, ``PATH.py:FUNC``, has no
    spec: its costs come from a calibration profile.)"""
    if isinstance(name_or_path, ModelSpec):      # a spec already (an imported job's: cost_models.frameworks)
        return name_or_path
    if is_model_ref(str(name_or_path)):
        raise SpecError(model_ref_help(str(name_or_path)))
    if is_hf_config(name_or_path):
        return spec_from_hf_config(name_or_path)
    data, source = read_yaml(name_or_path, "models", "model")
    return spec_from_dict(data, source)
