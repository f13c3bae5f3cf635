"""A model spec from a Hugging Face ``config.json`` (``--model path/config.json``).

Read architectures (the first of ``architectures``):

* ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` -> kind ``llama`` (RMSNorm,
  SwiGLU of ``intermediate_size``, rotary positions, grouped-query attention with
  ``num_key_value_heads``; Qwen2 adds biases to Q, K and V, Llama does with ``attention_bias``).
  Mistral's ``sliding_window`` attention is costed as full attention over the sequence (what it is
  up to the window; an upper bound beyond it): the spec's ``description`` says so.
* ``GPT2LMHeadModel`` -> kind ``gpt`` (``n_layer``, ``n_embd``, ``n_head``, ``n_inner`` or 4h,
  ``n_positions``), dropout when any of its dropout probabilities is above zero.

Every config model trains with flash attention (``attention: flash``). The training sequence is
``seq_len`` when given (``--seq-len``), else the config's ``max_position_embeddings`` (GPT-2:
``n_positions``). ``torch_dtype`` float32 gives 4-byte elements, anything else 2 (mixed precision).
``tie_word_embeddings`` says whether the head shares the token table (default: False for the
llama family, True for GPT-2). A missing or malformed field, an unknown architecture, a path that
is a folder or no JSON raise one :class:`~cost_models._spec.SpecError` naming the file and field.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ._spec import SpecError
from .files import FileError, read_text

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ARCHITECTURES = LLAMA_FAMILY + ("GPT2LMHeadModel",)


def is_hf_config(ref) -> bool:
    """``--model`` names a Hugging Face config: a path ending in ``.json``."""
    return str(ref).endswith(".json")


def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise SpecError(f"duplicate key {k!r}")
        seen[k] = v
    return seen


def _reject_constant(name):
    raise SpecError(f"{name} is not a number")


def read_config(path) -> dict:
    """The config's mapping (one-line errors: not a file, not JSON, duplicate keys, NaN)."""
    p = Path(path)
    if p.is_dir():
        raise SpecError(f"{p}: is a folder; give the config.json inside it (--model {p / 'config.json'})")
    try:
        text = read_text(p, "model config")
    except FileError as e:
        raise SpecError(str(e)) from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except SpecError as e:
        raise SpecError(f"{p}: {e}") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{p}: a Hugging Face config is a JSON object of fields")
    return data


def _int(data: dict, source: str, *names: str, default=None) -> int:
    """The first of ``names`` present, as a positive whole number (``default`` when none is)."""
    for n in names:
        if n in data and data[n] is not None:
            v = data[n]
            if isinstance(v, float) and math.isfinite(v) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"{source}: field {n!r} must be a positive whole number; got {v!r}")
            return v
    if default is not None:
        return default
    raise SpecError(f"{source}: missing field {names[0]!r}")


def _bool(data: dict, source: str, name: str, default: bool) -> bool:
    v = data.get(name, default)
    if not isinstance(v, bool):
        raise SpecError(f"{source}: field {name!r} must be true or false; got {v!r}")
    return v


def _dropout(data: dict, source: str, names) -> bool:
    on = False
    for n in names:
        v = data.get(n, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 1:
            raise SpecError(f"{source}: field {n!r} must be a probability in [0, 1); got {v!r}")
        on = on or v > 0
    return on


def hf_fields(path, seq_len: int | None = None, micro_batch: int = 1) -> dict:
    """The :class:`~cost_models.model_spec.ModelSpec` fields of the config at ``path`` (see the
    module docstring; :func:`cost_models.model_spec.spec_from_hf_config` builds the spec)."""
    p = Path(path)
    data = read_config(p)
    source = str(p)
    archs = data.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise SpecError(f"{source}: missing field 'architectures' (a list naming the model class, one of "
                        f"{', '.join(ARCHITECTURES)})")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise SpecError(f"{source}: architecture {arch} is not supported; supported: {', '.join(ARCHITECTURES)}")
    name = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
    dtype = data.get("torch_dtype", "bfloat16")
    if dtype is not None and not isinstance(dtype, str):
        raise SpecError(f"{source}: field 'torch_dtype' must be a string such as bfloat16; got {dtype!r}")
    fields = dict(name=name, dtype_bytes=4 if dtype == "float32" else 2, micro_batch=micro_batch,
                  attention="flash")
    if arch in LLAMA_FAMILY:
        hidden = _int(data, source, "hidden_size")
        heads = _int(data, source, "num_attention_heads")
        if hidden % heads:
            raise SpecError(f"{source}: hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})")
        head_dim = data.get("head_dim")
        if head_dim is not None and head_dim != hidden // heads:
            raise SpecError(f"{source}: field 'head_dim' {head_dim!r} differs from hidden_size / num_attention_heads "
                            f"({hidden // heads}); such models are not supported")
        fields.update(kind="llama", layers=_int(data, source, "num_hidden_layers"), hidden=hidden, heads=heads,
                      kv_heads=_int(data, source, "num_key_value_heads", default=heads),
                      ffn_hidden=_int(data, source, "intermediate_size"), vocab=_int(data, source, "vocab_size"),
                      seq_len=seq_len or _int(data, source, "max_position_embeddings"),
                      tied_embeddings=_bool(data, source, "tie_word_embeddings", False),
                      dropout=_dropout(data, source, ("attention_dropout",)),
                      qkv_bias=arch == "Qwen2ForCausalLM" or _bool(data, source, "attention_bias", False))
    else:
        hidden = _int(data, source, "n_embd")
        fields.update(kind="gpt", layers=_int(data, source, "n_layer"), hidden=hidden,
                      heads=_int(data, source, "n_head"), ffn_hidden=_int(data, source, "n_inner", default=4 * hidden),
                      vocab=_int(data, source, "vocab_size"),
                      seq_len=seq_len or _int(data, source, "n_positions", "n_ctx"),
                      tied_embeddings=_bool(data, source, "tie_word_embeddings", True),
                      dropout=_dropout(data, source, ("resid_pdrop", "embd_pdrop", "attn_pdrop")))
    return fields
