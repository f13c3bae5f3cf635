"""A model spec from a Hugging Face ``config.json`` (``--model path/config.json``).

Read architectures (the first of ``architectures``; any other is refused with one line naming
these):

* ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` -> kind
  ``llama`` (RMSNorm, SwiGLU of ``intermediate_size``, rotary positions, grouped-query attention
  with ``num_key_value_heads``; Qwen2 adds biases to Q, K and V, Llama, Mistral and Qwen3 do with
  ``attention_bias``). ``head_dim`` when it is no ``hidden_size / num_attention_heads`` is the
  spec's ``head_size`` (Qwen3: 128 for every size); Qwen3 adds an RMSNorm of each query and key head
  (``qk_norm``). Mistral's ``sliding_window`` attention is costed as full attention over the
  sequence (what it is up to the window; an upper bound beyond it).
* Mixtures of experts, kind ``llama`` with ``experts`` E routed experts, ``top_k`` k of them per
  token (``num_experts_per_tok``):

  - ``MixtralForCausalLM``: ``num_local_experts`` experts, each a SwiGLU of ``intermediate_size``,
    softmax router, every block a MoE.
  - ``Qwen2MoeForCausalLM``: ``num_experts`` of ``moe_intermediate_size``, one shared expert of
    ``shared_expert_intermediate_size`` behind a sigmoid gate (``shared_gate``), biases on Q, K
    and V (``qkv_bias``, default true).
  - ``Qwen3MoeForCausalLM``: ``num_experts`` of ``moe_intermediate_size``, no shared expert,
    ``head_dim`` and the q/k norms as Qwen3.
  - ``DeepseekV3ForCausalLM``: ``n_routed_experts`` of ``moe_intermediate_size``, ``n_shared_experts``
    shared ones (``shared_ffn`` = n_shared_experts x moe_intermediate_size), sigmoid scores with
    a per-expert bias (``scoring_func`` must be ``sigmoid``), the first ``first_k_dense_replace``
    blocks dense of ``intermediate_size`` (``moe_layer_freq`` must be 1); multi-head latent
    attention: ``q_lora_rank`` (null: a full query projection), ``kv_lora_rank``,
    ``qk_nope_head_dim`` (the spec's ``head_size``), ``qk_rope_head_dim``, ``v_head_dim``
    (``num_key_value_heads`` does not apply). The multi-token-prediction module
    (``num_nextn_predict_layers``) is not part of the main model and is not modelled: DeepSeek-V3
    is its 671 B-parameter main model. ``attention_bias`` true is refused.

  The sizes are required (``first_k_dense_replace`` 0, ``n_shared_experts`` and
  ``shared_expert_intermediate_size`` null or 0: none); ``decoder_sparse_step`` (1),
  ``mlp_only_layers`` ([]), ``moe_layer_freq`` (1) and ``scoring_func`` (sigmoid) default as in
  transformers.

  Both Qwen MoEs place their MoE blocks with ``decoder_sparse_step`` s (block i is a MoE when
  (i + 1) % s = 0) and ``mlp_only_layers`` (blocks kept dense, ``intermediate_size`` wide);
  pipetwin models the dense blocks as the first ``dense_layers``, so any other pattern (s = 2,
  or a dense block after a MoE) is refused with one line.

* ``GPT2LMHeadModel`` -> kind ``gpt`` (``n_layer``, ``n_embd``, ``n_head``, ``n_inner`` or 4h,
  ``n_positions``), dropout when any of its dropout probabilities is above zero.

A mixture-of-experts or latent-attention field of another architecture (e.g. ``num_local_experts``
on a ``LlamaForCausalLM``, any of them on ``GPT2LMHeadModel``) is refused with one line, not ignored.

Every config model trains with flash attention (``attention: flash``). The training sequence is
``seq_len`` when given (``--seq-len``), else the config's ``max_position_embeddings`` (GPT-2:
``n_positions``). ``torch_dtype`` float32 gives 4-byte elements, anything else 2 (mixed precision).
These choices change the numbers, so :func:`config_notes` states each in one line for the reports
(the sequence taken from ``max_position_embeddings``, fp32 from ``torch_dtype``, a
``sliding_window`` shorter than the sequence priced as full attention).
``tie_word_embeddings`` says whether the head shares the token table (default: False for the
llama family, True for GPT-2). A missing or malformed field, an unknown architecture, a path that
is a folder or no JSON raise one :class:`~cost_models._spec.SpecError` naming the file and field.
"""
from __future__ import annotations

import math
from pathlib import Path

from ._spec import SpecError
from .files import FileError, check_kind, parse_json, read_text

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")
ARCHITECTURES = LLAMA_FAMILY + MOE_ARCHITECTURES + ("GPT2LMHeadModel",)
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")     # RMSNorm of each query and key head
# the mixture-of-experts and latent-attention fields each architecture reads; one of them on an
# architecture that does not read it is refused (it would change the model and be ignored)
_QWEN_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers")
READS = {
    "MixtralForCausalLM": ("num_local_experts", "num_experts_per_tok"),
    "Qwen2MoeForCausalLM": _QWEN_MOE + ("shared_expert_intermediate_size",),
    "Qwen3MoeForCausalLM": _QWEN_MOE + ("num_local_experts",),
    "DeepseekV3ForCausalLM": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                              "first_k_dense_replace", "moe_layer_freq", "scoring_func", "q_lora_rank",
                              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                              "num_nextn_predict_layers"),
}
STRUCTURE_FIELDS = tuple(dict.fromkeys(f for fields in READS.values() for f in fields))


def is_hf_config(ref) -> bool:
    """``--model`` names a Hugging Face config: a path ending in ``.json``."""
    return str(ref).endswith(".json")


def _supported() -> str:
    """The supported architectures, short: ``Llama, Mistral, ... ForCausalLM, GPT2LMHeadModel``."""
    causal = [a.removesuffix("ForCausalLM") for a in ARCHITECTURES if a.endswith("ForCausalLM")]
    return f"{', '.join(causal)} ForCausalLM, " + ", ".join(a for a in ARCHITECTURES if not a.endswith("ForCausalLM"))


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
        data = parse_json(text, str(p))
        check_kind(data, str(p), "hf-config")
    except FileError as e:
        raise SpecError(str(e)) from None
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
                        f"{_supported()})")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise SpecError(f"{source}: field 'architectures': {arch} is not supported; supported: {_supported()}")
    name = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
    dtype = data.get("torch_dtype", "bfloat16")
    if dtype is not None and not isinstance(dtype, str):
        raise SpecError(f"{source}: field 'torch_dtype' must be a string such as bfloat16; got {dtype!r}")
    fields = dict(name=name, dtype_bytes=4 if dtype == "float32" else 2, micro_batch=micro_batch,
                  attention="flash")
    _foreign_fields(data, source, arch)
    if arch != "GPT2LMHeadModel":
        _sliding_window(data, source)       # a malformed window: one line now, not in the report
        fields.update(_llama_fields(data, source, arch, seq_len))
    else:
        hidden = _int(data, source, "n_embd")
        fields.update(kind="gpt", layers=_int(data, source, "n_layer"), hidden=hidden,
                      heads=_int(data, source, "n_head"), ffn_hidden=_int(data, source, "n_inner", default=4 * hidden),
                      vocab=_int(data, source, "vocab_size"),
                      seq_len=seq_len or _int(data, source, "n_positions", "n_ctx"),
                      tied_embeddings=_bool(data, source, "tie_word_embeddings", True),
                      dropout=_dropout(data, source, ("resid_pdrop", "embd_pdrop", "attn_pdrop")))
    return fields


def _sliding_window(data: dict, source: str) -> int | None:
    """The attention window a config uses (Mistral's ``sliding_window``; Qwen's only with
    ``use_sliding_window`` true), None when it attends to the whole sequence."""
    if data.get("sliding_window") is None or not _bool(data, source, "use_sliding_window", True):
        return None
    return _int(data, source, "sliding_window")


def config_notes(path, seq_len: int | None = None, precision: str | None = None) -> tuple[str, ...]:
    """One line per assumption reading the config at ``path`` makes that changes a number, for the
    reports: the sequence taken from ``max_position_embeddings`` (``seq_len`` None: not given), fp32
    from ``torch_dtype`` (``precision`` None: not given), a ``sliding_window`` shorter than the
    sequence priced as full attention."""
    data, source = read_config(path), str(path)
    gpt2 = (data.get("architectures") or [None])[0] == "GPT2LMHeadModel"
    field = "n_positions" if gpt2 and "n_positions" in data else "n_ctx" if gpt2 else "max_position_embeddings"
    seq = seq_len or _int(data, source, field)
    out = []
    if seq_len is None:
        out.append(f"sequence {seq:,} tokens from the config's {field} (the longest it takes, not its training "
                   f"length): give --seq-len S")
    if data.get("torch_dtype") == "float32" and precision is None:
        out.append("fp32 from the config's torch_dtype float32 (fp32 GEMMs, 4-byte weights and activations); for "
                   "bf16 mixed precision set torch_dtype to bfloat16 (--precision bf16 changes the GEMMs only)")
    window = None if gpt2 else _sliding_window(data, source)
    if window is not None and window < seq:
        out.append(f"sliding_window {window:,}: attention priced as full attention over the {seq:,}-token "
                   f"sequence, an upper bound (a token attends to at most {window:,})")
    return tuple(out)


def _foreign_fields(data: dict, source: str, arch: str) -> None:
    """Refuse a mixture-of-experts or latent-attention field ``arch`` does not read."""
    own = READS.get(arch, ())
    for f in STRUCTURE_FIELDS:
        if f not in own and data.get(f) is not None:
            owners = ", ".join(a for a, fs in READS.items() if f in fs)
            raise SpecError(f"{source}: field {f!r} is not read for {arch} (it is {owners}'s); pipetwin would ignore "
                            f"it: remove it or fix 'architectures'")


def _whole(data: dict, source: str, name: str) -> int:
    """A required integer >= 0; null is 0 (none: no shared expert, a full query projection)."""
    if name not in data:
        raise SpecError(f"{source}: missing field {name!r}")
    v = data[name]
    if v is None:
        return 0
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SpecError(f"{source}: field {name!r} must be a whole number >= 0; got {v!r}")
    return v


def _interleaved(what: str) -> SpecError:
    return SpecError(f"{what}; pipetwin models only leading dense blocks (the first dense_layers), so this MoE "
                     f"layout cannot be expressed")


def _qwen_dense_layers(data: dict, source: str, layers: int) -> int:
    """The leading dense blocks of a Qwen MoE (``decoder_sparse_step``, ``mlp_only_layers``): the
    blocks that are not MoE must be the first few, else one line says why it cannot be expressed."""
    step = _int(data, source, "decoder_sparse_step", default=1)
    only = data.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                                             for i in only):
        raise SpecError(f"{source}: field 'mlp_only_layers' must be a list of block indices 0..{layers - 1}; "
                        f"got {only!r}")
    dense = sorted(set(only) | {i for i in range(layers) if (i + 1) % step})
    if dense != list(range(len(dense))):
        raise _interleaved(f"{source}: decoder_sparse_step {step} makes a MoE of block i only when (i + 1) % {step} "
                           f"= 0" if step > 1 else f"{source}: mlp_only_layers {only} keeps block "
                           f"{next(i for i, j in enumerate(dense) if i != j)} a MoE between dense ones")
    return len(dense)


def _llama_fields(data: dict, source: str, arch: str, seq_len: int | None) -> dict:
    """The spec fields of a llama-family or mixture-of-experts config (see the module docstring)."""
    hidden = _int(data, source, "hidden_size")
    heads = _int(data, source, "num_attention_heads")
    layers = _int(data, source, "num_hidden_layers")
    fields = dict(kind="llama", layers=layers, hidden=hidden, heads=heads,
                  ffn_hidden=_int(data, source, "intermediate_size"), vocab=_int(data, source, "vocab_size"),
                  seq_len=seq_len or _int(data, source, "max_position_embeddings"),
                  tied_embeddings=_bool(data, source, "tie_word_embeddings", False),
                  dropout=_dropout(data, source, ("attention_dropout",)), qk_norm=arch in QK_NORM)
    if arch == "DeepseekV3ForCausalLM":
        fields.update(_deepseek_fields(data, source))
        return fields
    fields["kv_heads"] = _int(data, source, "num_key_value_heads", default=heads)
    if data.get("head_dim") is None and hidden % heads:
        raise SpecError(f"{source}: hidden_size ({hidden}) must be divisible by num_attention_heads ({heads}), "
                        f"or give head_dim")
    head_dim = _int(data, source, "head_dim", default=hidden // heads)
    fields["head_size"] = None if head_dim * heads == hidden else head_dim
    if arch == "Qwen2ForCausalLM":
        fields["qkv_bias"] = True
    elif arch == "Qwen2MoeForCausalLM":
        fields["qkv_bias"] = _bool(data, source, "qkv_bias", True)
    else:
        fields["qkv_bias"] = _bool(data, source, "attention_bias", False)
    if arch == "MixtralForCausalLM":
        fields.update(experts=_int(data, source, "num_local_experts"), top_k=_int(data, source, "num_experts_per_tok"))
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        fields.update(experts=_int(data, source, "num_experts", "num_local_experts"),
                      top_k=_int(data, source, "num_experts_per_tok"),
                      expert_ffn=_int(data, source, "moe_intermediate_size"),
                      dense_layers=_qwen_dense_layers(data, source, layers))
        if arch == "Qwen2MoeForCausalLM":
            shared = _whole(data, source, "shared_expert_intermediate_size")
            fields.update(shared_ffn=shared, shared_gate=shared > 0)
    return fields


def _deepseek_fields(data: dict, source: str) -> dict:
    """DeepSeek-V3's mixture of experts and multi-head latent attention (module docstring)."""
    if _bool(data, source, "attention_bias", False):
        raise SpecError(f"{source}: field 'attention_bias' true (biases on the latent projections) is not modelled")
    scoring = data.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise SpecError(f"{source}: field 'scoring_func' must be sigmoid for DeepseekV3ForCausalLM (its router adds "
                        f"a per-expert bias to sigmoid scores); got {scoring!r}")
    freq = _int(data, source, "moe_layer_freq", default=1)
    if freq != 1:
        raise _interleaved(f"{source}: moe_layer_freq {freq} makes a MoE of one block in {freq} after the dense ones")
    width = _int(data, source, "moe_intermediate_size")
    nope = _int(data, source, "qk_nope_head_dim")
    v = _int(data, source, "v_head_dim")
    return dict(experts=_int(data, source, "n_routed_experts"), top_k=_int(data, source, "num_experts_per_tok"),
                expert_ffn=width, shared_ffn=_whole(data, source, "n_shared_experts") * width,
                dense_layers=_whole(data, source, "first_k_dense_replace"), router="sigmoid",
                kv_lora_rank=_int(data, source, "kv_lora_rank"), q_lora_rank=_whole(data, source, "q_lora_rank"),
                rope_head_dim=_int(data, source, "qk_rope_head_dim"), head_size=nope,
                v_head_size=None if v == nope else v)
