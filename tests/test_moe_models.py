"""Mixture-of-experts and Qwen3 models: the presets' total and active parameters as exact integers
against the published sizes, the Hugging Face configs loading to the presets' specs, the configs
pipetwin refuses, and ``pipetwin presets`` reporting both counts.

The exact counts below are ours, worked by hand from the published config.json (tests/data/hf)
with the block formulas (h hidden, a heads of e, k key/value heads, f the dense SwiGLU, E experts
of f_e, top-k, V vocabulary; untied embeddings: 2Vh, plus the final norm h; every block two norms
2h):

  attention (grouped-query)  h a e + 2 h k e + a e h  (+ a e + 2 k e with Q/K/V biases,
                             + 2e with Qwen3's q/k norms)
  attention (DeepSeek MLA)   h q_r + q_r + q_r a (e + r) + h (kv_r + r) + kv_r + kv_r a (e + v) + a v h
  MoE MLP                    router E h (+ E: DeepSeek's sigmoid bias) + E 3 h f_e + shared 3 h f_s
                             (+ h: Qwen2-MoE's shared gate); active: k instead of E routed experts

Mixtral-8x7B (h 4096, a 32, e 128, k 8, f = f_e 14336, E 8, top-2, V 32000, 32 blocks):
  attention 16,777,216 + 2 x 4,194,304 + 16,777,216 = 41,943,040; experts 8 x 176,160,768 =
  1,409,286,144; router 32,768; norms 8,192 -> block 1,451,270,144 x 32 = 46,440,644,608;
  + 2 x 131,072,000 + 4,096 = 46,702,792,704 (published 46.7 B); active: block 394,305,536 x 32
  + 262,148,096 = 12,879,925,248 (published 12.9 B).
Mixtral-8x22B (h 6144, a 48, e 128, k 8, f_e 16384, E 8, top-2, V 32000, 56 blocks):
  attention 88,080,384; experts 8 x 301,989,888; router 49,152; norms 12,288 -> block
  2,504,060,928 x 56 + 2 x 196,608,000 + 6,144 = 140,620,634,112 (published 141 B; 140.6 B);
  active: block 692,121,600 x 56 + 393,222,144 = 39,152,031,744 (published 39 B; 39.15 B).
Qwen3-30B-A3B (h 2048, a 32, e 128, k 4, q/k norms, f_e 768, E 128, top-8, V 151936, 48 blocks):
  attention 18,874,368 + 256; experts 128 x 4,718,592 = 603,979,776; router 262,144; norms 4,096
  -> block 623,120,640 x 48 + 2 x 311,164,928 + 2,048 = 30,532,122,624 (published 30.5 B;
  non-embedding 29,909,792,768: published 29.9 B); active: block 56,889,600 x 48 + 622,331,904 =
  3,353,032,704 (published 3.3 B: 3.35 B, the model card truncates).
Qwen3-235B-A22B (h 4096, a 64, e 128, k 4, q/k norms, f_e 1536, E 128, top-8, V 151936, 94 blocks):
  attention 71,303,168 + 256; experts 128 x 18,874,368 = 2,415,919,104; router 524,288; norms
  8,192 -> block 2,487,755,008 x 94 + 2 x 622,329,856 + 4,096 = 235,093,634,560 (published 235 B;
  non-embedding 233,848,974,848: published 234 B); active: block 222,830,848 x 94 +
  1,244,663,808 = 22,190,763,520 (published 22 B).
DeepSeek-V3, the main model without its multi-token-prediction module (h 7168, a 128, e 128, r 64,
v 128, q_r 1536, kv_r 512, f 18432 in the first 3 blocks, E 256 of f_e 2048, top-8, 1 shared of
2048, V 129280, 61 blocks):
  attention 11,010,048 + 1,536 + 37,748,736 + 4,128,768 + 512 + 16,777,216 + 117,440,512 =
  187,107,328; norms 14,336; dense MLP 396,361,728; MoE MLP 256 x 44,040,192 + 44,040,192 +
  1,835,008 + 256 = 11,320,164,608 -> 3 x 583,483,392 + 58 x 11,507,286,272 + 2 x 926,679,040 +
  7,168 = 671,026,419,200 (published 671 B); active: MoE MLP 398,196,992, block 585,318,656 ->
  37,552,297,472, which counts the input embedding (926,679,040) as every count here does;
  without it 36,625,618,432, DeepSeek's published 36.6 B "including 0.9 B for the output head"
  (its 37 B).
Qwen1.5-MoE-A2.7B (Qwen2-MoE: h 2048, a 16, e 128, k 16, Q/K/V biases, E 60 of 1408, top-4, one
gated shared expert of 5632, V 151936, 24 blocks): attention 16,777,216 + 6,144; experts
519,045,120; shared 34,603,008 + 2,048; router 122,880; norms 4,096 -> block 570,560,512 x 24 +
2 x 311,164,928 + 2,048 = 14,315,784,192 (published 14.3 B); active: block 86,118,400 x 24 +
622,331,904 = 2,689,173,504 (published 2.7 B).
Qwen3-32B (dense; h 5120, a 64 heads of 128 (not 5120 / 64 = 80), k 8, q/k norms, f 25600, V 151936,
64 blocks): attention 94,371,840 + 256; MLP 393,216,000; norms 10,240 -> block 487,598,336 x 64 +
2 x 777,912,320 + 5,120 = 32,762,123,264 (published 32.8 B; non-embedding 31,206,298,624:
published 31.2 B).
"""
import dataclasses
import json
from pathlib import Path

import pytest

import cost_models as cm
from cost_models.model_spec import spec_from_hf_config
from cost_models.transformer import active_params, model_params
from experiments.cli import main

HF = Path(__file__).parent / "data" / "hf"

# preset, its config folder, exact total, exact active, published total and active (B), rounding
EXACT = [
    ("mixtral-8x7b", "Mixtral-8x7B-v0.1", 46_702_792_704, 12_879_925_248),
    ("mixtral-8x22b", "Mixtral-8x22B-v0.1", 140_620_634_112, 39_152_031_744),
    ("qwen3-30b-a3b", "Qwen3-30B-A3B", 30_532_122_624, 3_353_032_704),
    ("qwen3-235b-a22b", "Qwen3-235B-A22B", 235_093_634_560, 22_190_763_520),
    ("deepseek-v3", "DeepSeek-V3", 671_026_419_200, 37_552_297_472),
]


@pytest.mark.parametrize("preset,folder,total,active", EXACT)
def test_preset_parameters_exact(preset, folder, total, active):
    spec = cm.load_model(preset)
    assert (model_params(spec), active_params(spec)) == (total, active)


@pytest.mark.parametrize("preset,folder,total,active", EXACT)
def test_config_parameters_exact(preset, folder, total, active):
    spec = cm.load_model(str(HF / folder / "config.json"))
    assert (model_params(spec), active_params(spec)) == (total, active)


def test_published_sizes():
    """The exact counts against the published rounded figures (module docstring): rounded to the
    published digits, except where a publisher truncates (Qwen3-30B-A3B's 3.35 B active as 3.3 B,
    Mixtral-8x22B's 39.15 B as 39 B) or leaves the input embedding out (DeepSeek-V3's 36.6 B)."""
    b = {name: (model_params(cm.load_model(name)) / 1e9, active_params(cm.load_model(name)) / 1e9)
         for name, *_ in EXACT}
    assert (round(b["mixtral-8x7b"][0], 1), round(b["mixtral-8x7b"][1], 1)) == (46.7, 12.9)
    assert (round(b["mixtral-8x22b"][0]), round(b["mixtral-8x22b"][1], 2)) == (141, 39.15)
    assert (round(b["qwen3-30b-a3b"][0], 1), round(b["qwen3-30b-a3b"][1], 2)) == (30.5, 3.35)
    assert (round(b["qwen3-235b-a22b"][0]), round(b["qwen3-235b-a22b"][1])) == (235, 22)
    assert round(b["deepseek-v3"][0]) == 671
    ds = cm.load_model("deepseek-v3")
    embedding = ds.vocab * ds.hidden
    assert embedding == 926_679_040
    assert active_params(ds) - embedding == 36_625_618_432           # DeepSeek's 36.6 B


@pytest.mark.parametrize("folder,total,active", [
    ("Qwen1.5-MoE-A2.7B", 14_315_784_192, 2_689_173_504),
    ("Qwen3-32B", 32_762_123_264, 32_762_123_264),
])
def test_other_configs_exact(folder, total, active):
    spec = cm.load_model(str(HF / folder / "config.json"))
    assert (model_params(spec), active_params(spec)) == (total, active)


def _resolved(spec: cm.ModelSpec) -> dict:
    """A spec's fields with the ones that default by kind resolved (None = the kind's value)."""
    d = spec.to_dict()
    d.update(kv_heads=spec.kv, ffn_hidden=spec.ffn, tied_embeddings=spec.tied, dropout=spec.has_dropout,
             attention=spec.attention_kind, head_size=spec.head_dim, v_head_size=spec.v_head_dim,
             expert_ffn=spec.expert_width)
    del d["name"], d["seq_len"]
    return d


@pytest.mark.parametrize("preset,folder,total,active", EXACT)
def test_config_loads_to_the_preset(preset, folder, total, active):
    spec = spec_from_hf_config(HF / folder / "config.json", seq_len=4096)
    assert spec.seq_len == 4096 and spec.name == folder
    assert _resolved(spec) == _resolved(cm.load_model(preset))


def test_config_fields_mapped():
    ds = cm.load_model(str(HF / "DeepSeek-V3" / "config.json"))
    assert (ds.experts, ds.top_k, ds.expert_width, ds.shared_ffn, ds.dense_layers, ds.router, ds.ffn) == \
        (256, 8, 2048, 2048, 3, "sigmoid", 18432)
    assert (ds.kv_lora_rank, ds.q_lora_rank, ds.head_dim, ds.rope_head_dim, ds.v_head_dim, ds.moe_layers) == \
        (512, 1536, 128, 64, 128, 58)
    q2 = cm.load_model(str(HF / "Qwen1.5-MoE-A2.7B" / "config.json"))
    assert (q2.experts, q2.top_k, q2.expert_width, q2.shared_ffn, q2.shared_gate, q2.qkv_bias, q2.qk_norm) == \
        (60, 4, 1408, 5632, True, True, False)
    q3 = cm.load_model(str(HF / "Qwen3-32B" / "config.json"))
    assert (q3.is_moe, q3.head_dim, q3.qk_norm, q3.kv, q3.qkv_bias) == (False, 128, True, 8, False)
    mx = cm.load_model(str(HF / "Mixtral-8x7B-v0.1" / "config.json"))
    assert (mx.experts, mx.top_k, mx.expert_width, mx.shared_ffn, mx.head_size, mx.qk_norm) == \
        (8, 2, 14336, 0, None, False)


ABSENT = object()      # a field taken out of the config


def _write(tmp_path, folder, change) -> Path:
    data = json.loads((HF / folder / "config.json").read_text())
    data.update(change)
    data = {k: v for k, v in data.items() if v is not ABSENT}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(data))
    return p


@pytest.mark.parametrize("folder,change,message", [
    ("Meta-Llama-3-8B", {"num_local_experts": 8}, "field 'num_local_experts' is not read for LlamaForCausalLM (it "
                                                  "is MixtralForCausalLM, Qwen3MoeForCausalLM's); pipetwin would "
                                                  "ignore it: remove it or fix 'architectures'"),
    ("gpt2", {"n_routed_experts": 64}, "field 'n_routed_experts' is not read for GPT2LMHeadModel"),
    ("Mixtral-8x7B-v0.1", {"kv_lora_rank": 512}, "field 'kv_lora_rank' is not read for MixtralForCausalLM (it is "
                                                 "DeepseekV3ForCausalLM's)"),
    ("Qwen3-30B-A3B", {"decoder_sparse_step": 2}, "decoder_sparse_step 2 makes a MoE of block i only when (i + 1) "
                                                  "% 2 = 0; pipetwin models only leading dense blocks (the first "
                                                  "dense_layers), so this MoE layout cannot be expressed"),
    ("Qwen3-30B-A3B", {"mlp_only_layers": [0, 2]}, "mlp_only_layers [0, 2] keeps block 1 a MoE between dense ones"),
    ("Qwen3-30B-A3B", {"mlp_only_layers": [48]}, "field 'mlp_only_layers' must be a list of block indices 0..47"),
    ("Qwen3-30B-A3B", {"num_experts_per_tok": None}, "missing field 'num_experts_per_tok'"),
    ("Qwen3-30B-A3B", {"num_experts_per_tok": 129}, "field 'top_k' must be 1..experts (128)"),
    ("DeepSeek-V3", {"scoring_func": "softmax"}, "field 'scoring_func' must be sigmoid for DeepseekV3ForCausalLM"),
    ("DeepSeek-V3", {"moe_layer_freq": 2}, "moe_layer_freq 2 makes a MoE of one block in 2 after the dense ones; "
                                           "pipetwin models only leading dense blocks"),
    ("DeepSeek-V3", {"first_k_dense_replace": ABSENT}, "missing field 'first_k_dense_replace'"),
    ("Qwen1.5-MoE-A2.7B", {"shared_expert_intermediate_size": ABSENT}, "missing field "
                                                                       "'shared_expert_intermediate_size'"),
    ("DeepSeek-V3", {"attention_bias": True}, "field 'attention_bias' true (biases on the latent projections) is "
                                              "not modelled"),
    ("DeepSeek-V3", {"n_shared_experts": -1}, "field 'n_shared_experts' must be a whole number >= 0; got -1"),
    ("Qwen3-32B", {"head_dim": 0}, "field 'head_dim' must be a positive whole number; got 0"),
    ("Mixtral-8x7B-v0.1", {"architectures": ["GptOssForCausalLM"]},
     "field 'architectures': GptOssForCausalLM is not supported; supported: Llama, Mistral, Qwen2, Qwen3, Mixtral, "
     "Qwen2Moe, Qwen3Moe, DeepseekV3 ForCausalLM, GPT2LMHeadModel"),
])
def test_config_refusals(tmp_path, folder, change, message):
    with pytest.raises(cm.SpecError) as e:
        cm.load_model(str(_write(tmp_path, folder, change)))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_expressible_layouts(tmp_path):
    """Leading dense blocks are read as dense_layers (intermediate_size wide); a null query rank is a
    full query projection; v_head_dim equal to qk_nope_head_dim is the default."""
    spec = cm.load_model(str(_write(tmp_path, "Qwen3-30B-A3B", {"mlp_only_layers": [1, 0]})))
    assert (spec.dense_layers, spec.moe_layers, spec.ffn) == (2, 46, 6144)
    full = model_params(cm.load_model(str(_write(tmp_path, "Qwen3-30B-A3B", {}))))
    dense_block = 3 * 2048 * 6144 - (128 * 3 * 2048 * 768 + 2048 * 128)      # dense MLP less the MoE MLP
    assert model_params(spec) == full + 2 * dense_block
    data = json.loads((HF / "Qwen3-30B-A3B" / "config.json").read_text())
    data["num_local_experts"] = data.pop("num_experts")     # newer transformers saves Qwen3-MoE's under this name
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert cm.load_model(str(tmp_path / "config.json")).experts == 128
    ds = cm.load_model(str(_write(tmp_path, "DeepSeek-V3", {"q_lora_rank": None, "v_head_dim": 128})))
    assert (ds.q_lora_rank, ds.v_head_size) == (0, None)
    # the query projection h x a(e + r) instead of h q_r + q_r (its norm) + q_r a(e + r), in each of 61 blocks
    assert model_params(cm.load_model("deepseek-v3")) - model_params(ds) == \
        61 * (7168 * 1536 + 1536 + 1536 * 128 * 192 - 7168 * 128 * 192)


def test_presets_report_total_and_active(capsys):
    assert main(["presets", "models"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120
    joined = " ".join(out.split())
    assert "8 experts of 14336, top-2, s 32768, V 32000, b 1: 46.7 B parameters, 12.9 B active" in joined
    assert ("128 heads of 128, latent attention (q rank 1536, kv rank 512, rope 64), 256 experts of 2048, top-8, "
            "shared 2048, sigmoid router, first 3 dense (ffn 18432), s 4096, V 129280, b 1: 671.0 B parameters, "
            "37.6 B active") in joined
    assert "32 heads (8 kv), ffn 14336, s 8192, V 128256, b 1: 8.0 B parameters, 8.0 B active" in joined
    assert main(["presets", "models", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    models = {m["name"]: m for m in rec["models"]}
    for name, _, total, active in EXACT:
        assert (models[name]["parameters"], models[name]["active_parameters"]) == (total, active)
    assert models["llama3-8b"]["parameters"] == models["llama3-8b"]["active_parameters"] == 8_030_261_248
    assert all(m["parameters"] == m["active_parameters"] for m in rec["models"] if not m["experts"])
    assert set(rec) == {"models", "paper_models"} and "vgg-19" in rec["paper_models"]
    assert dataclasses.asdict(cm.load_model("deepseek-v3")) == \
        {k: v for k, v in models["deepseek-v3"].items() if k not in ("parameters", "active_parameters")}


# ---------------------------------------------------------------------------- the kernel cost model
@pytest.mark.parametrize("model,why", [
    ("mixtral-8x7b", "experts"), ("deepseek-v3", "experts"),
    (str(HF / "Qwen3-32B" / "config.json"), "heads of 128 (not hidden / heads = 80)"),
])
def test_kernel_model_refuses_blocks_it_does_not_price(model, why):
    """The kernel model prices dense blocks of hidden / heads wide heads: MoE, MLA and Qwen3's heads
    default to the linear model and refuse --cost-model kernels in one line."""
    from cost_models.bind import cost_model_for
    from cost_models.kernels import block_shape, unpriced
    spec = cm.load_model(model)
    h100 = cm.load_device("h100")
    assert h100.kernels is not None and unpriced(spec) == why
    assert cost_model_for(None, h100, False, spec) == "linear"
    assert cost_model_for(None, h100, False, cm.load_model("llama3-8b")) == "kernels"
    message = (f"--cost-model kernels prices dense gpt, bert and llama blocks; model {spec.name} has {why}: use "
               f"--cost-model linear (the default for it)")
    for refuse in (lambda: cost_model_for("kernels", h100, False, spec), lambda: block_shape(spec)):
        with pytest.raises(ValueError) as e:
            refuse()
        assert str(e.value) == message
    assert unpriced(cm.load_model("qwen3-30b-a3b").replace(experts=0, top_k=0, expert_ffn=None)) == \
        "heads of 128 (not hidden / heads = 64)"
    assert unpriced(cm.load_model(str(HF / "Qwen3-32B" / "config.json")).replace(head_size=80)) == "query/key norms"


def test_cli_cost_model_default_and_refusal(capsys):
    """simulate and plan --search dapple take the linear model for a MoE preset by default, and
    refuse --cost-model kernels with one line."""
    rc = main(["simulate", "-s", "1f1b", "-D", "4", "-N", "8", "-m", "qwen3-30b-a3b", "--cluster", "dgx-h100-4x8-ib",
               "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["cost_model"] == "linear"
    for cmd in (["simulate", "-s", "1f1b", "-D", "4", "-N", "8"], ["plan", "--search", "dapple", "--global-batch", "32",
                                                                  "--no-progress"]):
        assert main([*cmd, "-m", "qwen3-30b-a3b", "--cluster", "dgx-h100-4x8-ib", "--cost-model", "kernels"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == ("pipetwin: error: --cost-model kernels prices dense gpt, bert and llama blocks; model "
                       "qwen3-30b-a3b has experts: use --cost-model linear (the default for it)")

