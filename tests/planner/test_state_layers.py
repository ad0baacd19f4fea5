"""State layers in the planner: Qwen3-Next / Qwen3.5 (Gated DeltaNet), Nemotron-H, Granite 4
and Falcon-H1 (Mamba-2): layer kinds, state shapes, page unification, groups, report, errors.

The expected numbers are vLLM 0.33's (``/work/wt/notes_vllm_mamba.md`` §5-7): Qwen3-Next-80B-A3B,
bf16, block 16 -> block 544, page 1,114,112 B, each state padded by 16,384 B.
"""

import json

import pytest

from hybridkv.cli import main
from hybridkv.core.specs import FullAttentionSpec, cdiv
from hybridkv.core.state_spec import StateSpec
from hybridkv.errors import InvalidConfigError, UnknownArchitectureError
from hybridkv.planner.architectures import model_layers
from hybridkv.planner.plan import plan_memory, plan_model
from hybridkv.planner.presets import load_model_config
from hybridkv.planner.report import plan_to_dict, render_plan

L = 262_144


def qwen3_next(**kw):
    return {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 8, "hidden_size": 256, **kw}


# ------------------------------------------------------------------ Qwen3-Next-80B-A3B: vLLM's numbers
def test_qwen3_next_preset_layers_pages_and_groups():
    m = model_layers(load_model_config("qwen3-next-80b-a3b").config)
    assert [k.kind for k in m.kinds] == (["linear"] * 3 + ["full"]) * 12
    assert (m.block_size, m.requested_block_size, m.num_layers, len(m.specs)) == (544, 16, 48, 48)
    state = m.state_specs[0]
    assert state.shapes == ((3, 8192), (32, 128, 128)) and state.dtypes == ("bfloat16", "bfloat16")
    assert (state.real_page_size_bytes, state.page_size_bytes, state.padding_bytes) == (1_097_728, 1_114_112, 16_384)
    assert {s.page_size_bytes for s in m.specs} == {1_114_112}
    assert m.specs[3] == FullAttentionSpec(block_size=544, num_kv_heads=2, head_size=256, dtype="bfloat16")
    assert state.max_num_blocks(L, 2048) == 2

    plan = plan_memory(m, 80 * 2**30, L)
    g = plan.hybrid.grouping
    assert (g.group_size, g.num_groups, g.padding_layers) == (12, 4, 0)
    assert [type(x.spec).__name__ for x in g.groups] == ["FullAttentionSpec"] + ["StateSpec"] * 3
    assert [x.layers[:2] for x in g.groups] == [(3, 7), (0, 4), (1, 5), (2, 6)]
    assert g.bytes_per_block == 12 * 1_114_112
    assert plan.hybrid.blocks_per_request == cdiv(L, 544) + 3 * 2 == 488
    assert g.request_bytes(L) == (12 * 482 * 1_114_112, 36 * 2 * 1_114_112, 0)
    # the all-full layout keeps the states: Qwen3-Next's attention layers are full already
    assert [x.spec for x in plan.full.grouping.groups] == [x.spec for x in g.groups]
    assert plan.concurrency_ratio == 1.0
    names = plan.kv_cache_config.groups[1].layer_names
    assert names[:2] == ("layers.0.state", "layers.4.state")
    assert plan.tensors[0].layer_names == ("layers.3", "layers.0.state", "layers.1.state", "layers.2.state")


def test_qwen3_next_report_text():
    text = render_plan(plan_model("qwen3-next-80b-a3b", memory="80GiB"))
    lines = text.splitlines()
    assert lines[:5] == [
        "model       Qwen/Qwen3-Next-80B-A3B-Instruct (Qwen3NextForCausalLM)",
        "layers      48: 36 gated_delta_net state, 12 full_attention",
        "kv cache    2 KV heads x head_dim 256, bfloat16, block size 544 -> 1.06 MiB per layer per block",
        "state       gated_delta_net: conv (3, 8192) bfloat16 + ssm (32, 128, 128) bfloat16 = 1,097,728 B per layer",
        "page        block size 16 -> 544: the smallest multiple of 16 whose KV page (544 x 2,048 B) holds a state; "
        "page 1,114,112 B, the state padded by 16,384 B (+1.49%)",
    ]
    assert ("1      gated_delta_net state      12        0               2           1,088      25.50 MiB"
            "  0, 4, 8, ..., 44") in lines
    assert "per request @ 262,144 tokens: KV 6.00 GiB + state 76.50 MiB + padded slots 0 B" in lines
    hybrid = next(line for line in lines if line.startswith("hybrid  "))
    assert hybrid.split()[1:6] == ["4", "12", "12.75", "MiB", "6,425"]


def test_qwen3_next_json_round_trip():
    d = plan_to_dict(plan_model("qwen3-next-80b-a3b", memory="80GiB"))
    assert json.loads(json.dumps(d)) == d
    assert d["model"]["block_size"] == 544 and d["model"]["requested_block_size"] == 16
    assert d["model"]["layer_types"][:4] == ["mamba", "mamba", "mamba", "full_attention"]
    assert d["model"]["states"] == [{
        "kind": "mamba", "state_type": "gated_delta_net", "block_size": 544, "shapes": [[3, 8192], [32, 128, 128]],
        "dtypes": ["bfloat16", "bfloat16"], "real_page_size_bytes": 1_097_728, "page_size_bytes": 1_114_112,
        "padding_bytes": 16_384}]
    h = d["hybrid"]
    assert (h["kv_bytes_per_request"], h["state_bytes_per_request"]) == (12 * 482 * 1_114_112, 72 * 1_114_112)
    assert [grp["bytes_per_request"] for grp in h["groups"]] == [12 * 482 * 1_114_112] + [24 * 1_114_112] * 3


def test_qwen3_next_fp8_kv_raises_the_block_and_leaves_the_state():
    m = model_layers(load_model_config("qwen3-next-80b-a3b").config, dtype="fp8")
    # 1,024 KV bytes a token: 16 * cdiv(1_097_728, 16 * 1024) = 16 * 67 = 1072, exactly the state: no padding
    assert m.block_size == 1072 and m.state_specs[0].dtypes == ("bfloat16", "bfloat16")
    assert m.state_specs[0].padding_bytes == 0 and m.state_specs[0].page_size_padded is None


def test_requested_block_size_is_a_divisor_of_the_raised_one():
    m = model_layers(load_model_config("qwen3-next-80b-a3b").config, block_size=96)
    # alignment lcm(16, 96) = 96: 96 * cdiv(1_097_728, 96 * 2048) = 96 * 6 = 576
    assert m.block_size == 576 and m.requested_block_size == 96
    big = model_layers(load_model_config("qwen3-next-80b-a3b").config, block_size=1024)
    assert big.block_size == 1024 and big.state_specs[0].padding_bytes == 1024 * 2048 - 1_097_728


def test_qwen3_5_preset_fp32_ssm_state():
    m = model_layers(load_model_config("qwen3.5-35b-a3b").config)
    s = m.state_specs[0]
    assert s.dtypes == ("bfloat16", "float32") and s.real_page_size_bytes == 49_152 + 2_097_152
    assert (m.block_size, s.page_size_bytes, s.padding_bytes) == (1056, 1056 * 2048, 16_384)
    assert [k.kind for k in m.kinds].count("full") == 10 and m.family == "qwen3_5_moe"


def test_qwen_interval_and_layer_types():
    assert [k.kind for k in model_layers(qwen3_next(full_attention_interval=2)).kinds] == ["linear", "full"] * 4
    types = ["full_attention", "linear_attention"] * 4
    assert [k.kind for k in model_layers(qwen3_next(layer_types=types)).kinds] == ["full", "linear"] * 4
    dense = {"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64}
    m = model_layers(dense)
    assert (m.family, m.num_kv_heads, m.state_specs[0].dtypes) == ("qwen3_5", 4, ("bfloat16", "bfloat16"))


# ------------------------------------------------------------------ transformers' own config classes
transformers = pytest.importorskip("transformers")


def mamba2_shapes(kernel, intermediate, groups, state, heads, head_dim):
    """vLLM's ``mamba2_state_shape`` at tensor parallel 1."""
    return (kernel - 1, intermediate + 2 * groups * state), (heads, head_dim, state)


def test_nemotron_h_from_transformers_config():
    hf = transformers.NemotronHConfig(
        hybrid_override_pattern="M-M*EM*", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=3)
    m = model_layers(hf.to_dict())
    expected = {"linear_attention": "linear", "full_attention": "full", "moe": "none", "mlp": "none"}
    assert [k.kind for k in m.kinds] == [expected[t] for t in hf.layers_block_type]
    assert m.cache_layers == (0, 2, 3, 5, 6)  # the MoE and MLP layers (1, 4) keep nothing
    s = m.state_specs[0]
    assert s.shapes == mamba2_shapes(3, 8 * 8, 2, 16, 8, 8) and s.state_type == "mamba2"
    assert s.dtypes == ("bfloat16", "float32")  # NemotronH's mamba_ssm_cache_dtype
    # 128 KV bytes a token (2 heads x 16 x 2 x bf16); state 2*128*2 + 8*8*16*4 = 4608 B -> 16 * cdiv(4608, 2048)
    assert m.block_size == 48 and {x.page_size_bytes for x in m.specs} == {48 * 128}
    text = render_plan(plan_memory(m, 2**30, 4096))
    assert "layers      7: 3 mamba2 state, 2 no cache, 2 full_attention" in text


def test_nemotron_h_legacy_kwargs_and_names():
    cfg = {"architectures": ["NemotronHForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "layers_block_type": ["linear_attention", "full_attention"], "mamba_n_groups": 1, "mamba_d_conv": 2}
    s = model_layers(cfg).state_specs[0]
    assert s.shapes == mamba2_shapes(2, 128 * 64, 1, 128, 128, 64)
    assert model_layers({**cfg, "layers_block_type": None, "layer_types": ["mamba", "attention"]}).kinds == \
        model_layers(cfg).kinds


def test_granite_moe_hybrid_from_transformers_config():
    hf = transformers.GraniteMoeHybridConfig(
        layer_types=["mamba", "attention", "mamba", "mamba"], num_hidden_layers=4, hidden_size=64,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=1)
    m = model_layers(hf.to_dict())
    assert [k.kind for k in m.kinds] == ["linear", "full", "linear", "linear"]
    assert m.state_specs[0].shapes == mamba2_shapes(4, 2 * 64, 1, 16, 8, hf.mamba_d_head)
    assert m.head_dim == 16  # hidden // heads: the class has no head_dim
    assert [k.kind for k in model_layers({"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 3,
                                          "hidden_size": 64, "mamba_n_heads": 8}).kinds] == ["linear"] * 3


def test_falcon_h1_every_layer_has_attention_and_state():
    hf = transformers.FalconH1Config(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8)
    m = model_layers(hf.to_dict())
    assert m.cache_layers == (0, 0, 1, 1, 2, 2, 3, 3)
    assert [type(s).__name__ for s in m.specs[:2]] == ["FullAttentionSpec", "StateSpec"]
    assert m.state_specs[0].shapes == mamba2_shapes(4, 32, 1, 8, 4, hf.mamba_d_head)
    plan = plan_memory(m, 2**30, 4096)
    g = plan.hybrid.grouping
    assert [(type(x.spec).__name__, x.layers) for x in g.groups] == [
        ("FullAttentionSpec", (0, 1, 2, 3)), ("StateSpec", (0, 1, 2, 3))]
    assert plan.kv_cache_config.groups[1].layer_names == ("layers.0.state", "layers.1.state", "layers.2.state",
                                                          "layers.3.state")
    assert "layers      4: 4 full_attention + mamba2 state" in render_plan(plan)
    assert plan_to_dict(plan)["model"]["layer_types"] == ["full_attention+mamba"] * 4


# ------------------------------------------------------------------ bad configs: typed errors, CLI exit 2
@pytest.mark.parametrize("cfg, error, message", [
    (qwen3_next(layer_types=["linear_attention", "sliding_attention"] * 4), InvalidConfigError,
     r"layer_types\[1\] is 'sliding_attention'; expected one of \['attention', 'full_attention', 'linear_attention', "
     r"'mamba'\]"),
    (qwen3_next(linear_num_value_heads=None), InvalidConfigError, "linear_num_value_heads must be a positive integer"),
    (qwen3_next(linear_conv_kernel_dim=1), InvalidConfigError, "linear_conv_kernel_dim is 1; a causal convolution"),
    (qwen3_next(linear_key_head_dim="128"), InvalidConfigError, "linear_key_head_dim must be a positive integer"),
    (qwen3_next(full_attention_interval=0), InvalidConfigError, "full_attention_interval must be a positive integer"),
    (qwen3_next(mamba_ssm_dtype="float99"), InvalidConfigError, "mamba_ssm_dtype is 'float99'; expected one of"),
    ({"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M*X"}, InvalidConfigError,
     r"hybrid_override_pattern has \['X'\]; expected only M, \*, E, -"),
    ({"architectures": ["NemotronHForCausalLM"], "num_hidden_layers": 4}, InvalidConfigError,
     "layers_block_type is missing"),
    ({"architectures": ["NemotronHForCausalLM"], "layers_block_type": ["mlp", "moe"]}, InvalidConfigError,
     "no layer keeps a KV cache or a state"),
    ({"architectures": ["NemotronHForCausalLM"], "layers_block_type": ["mamba2"]}, InvalidConfigError,
     r"layers_block_type\[0\] is 'mamba2'"),
    ({"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
      "mamba_n_heads": 7}, InvalidConfigError, r"mamba_n_heads \(7\) does not divide the Mamba intermediate size"),
    ({"architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "mamba_d_head": 3},
     InvalidConfigError, r"mamba_d_head \(3\) x mamba_n_heads \(128\) is not the intermediate size 1024"),
    ({"architectures": ["Qwen4NextForCausalLM"]}, UnknownArchitectureError, "unsupported architecture"),
])
def test_bad_state_configs_are_typed_errors(cfg, error, message):
    with pytest.raises(error, match=message):
        model_layers(cfg)


def test_cli_bad_state_config_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(qwen3_next(layer_types=["linear_attention", "banana"] * 4)))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "layer_types[1] is 'banana'" in err


def test_cli_plan_json_of_the_preset(capsys):
    assert main(["plan", "qwen3-next-80b-a3b", "--json", "--max-model-len", "128k"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["model"]["block_size"] == 544 and d["hybrid"]["page_size_bytes"] == 1_114_112
    assert isinstance(d["model"]["states"][0]["shapes"][0], list)


def test_state_specs_are_state_specs():
    assert all(isinstance(s, StateSpec) for s in model_layers(qwen3_next()).state_specs)
