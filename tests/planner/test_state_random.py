"""Random state-model configs: the planner's invariants, and its layer kinds / state shapes
against transformers 5.24's config classes.

Invariants, for any mix of layer types, head counts, kernels, dtypes and block sizes:
every spec's page is equal; a state's padding is >= 0 and less than one alignment step
of KV (``lcm(16, block) x KV bytes a token``), so the block size is the smallest that
holds it; a request holds at most 2 blocks of a state layer; every cache of every layer
is in exactly one group of the hybrid and of the all-full layout, states as states; the
plan's JSON round-trips.
"""

import json
from math import lcm, prod

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples

from hybridkv.core.specs import FullAttentionSpec, KVCacheSpec, cdiv, dtype_bytes
from hybridkv.core.state_spec import StateSpec
from hybridkv.planner.architectures import cache_name, model_layers
from hybridkv.planner.plan import plan_memory
from hybridkv.planner.report import plan_to_dict, render_plan

transformers = pytest.importorskip("transformers")

NEMOTRON = {"linear_attention": "linear", "full_attention": "full", "moe": "none", "mlp": "none"}
DTYPES = ["bfloat16", "float16", "float32"]


@st.composite
def state_configs(draw):
    """(config.json, the transformers config class's kwargs, its class name)."""
    family = draw(st.sampled_from(["qwen3_next", "qwen3_5_moe", "nemotron_h", "granitemoehybrid", "falcon_h1"]))
    n = draw(st.integers(1, 12))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kw = {"hidden_size": heads * draw(st.sampled_from([8, 16, 32])), "num_attention_heads": heads,
          "num_key_value_heads": draw(st.sampled_from([d for d in (1, 2, 4, 8) if heads % d == 0]))}
    if draw(st.booleans()):
        kw["torch_dtype"] = draw(st.sampled_from(DTYPES))
    if family in ("qwen3_next", "qwen3_5_moe"):
        kw.update(num_hidden_layers=n, head_dim=draw(st.sampled_from([8, 16, 64])),
                  linear_num_key_heads=draw(st.integers(1, 8)), linear_num_value_heads=draw(st.integers(1, 16)),
                  linear_key_head_dim=draw(st.sampled_from([4, 8, 32])),
                  linear_value_head_dim=draw(st.sampled_from([4, 8, 32])),
                  linear_conv_kernel_dim=draw(st.integers(2, 5)))
        if draw(st.booleans()):
            kw["layer_types"] = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]),
                                              min_size=n, max_size=n))
        else:
            kw["full_attention_interval"] = draw(st.integers(1, 5))
        if family == "qwen3_5_moe" and draw(st.booleans()):
            kw["mamba_ssm_dtype"] = "float32"
        cls = "Qwen3NextConfig" if family == "qwen3_next" else "Qwen3_5MoeTextConfig"
        arch = "Qwen3NextForCausalLM" if family == "qwen3_next" else "Qwen3_5MoeForCausalLM"
    elif family == "nemotron_h":
        kw.update(head_dim=draw(st.sampled_from([8, 16])), mamba_num_heads=draw(st.integers(1, 16)),
                  mamba_head_dim=draw(st.sampled_from([4, 8])), n_groups=draw(st.integers(1, 4)),
                  ssm_state_size=draw(st.sampled_from([8, 16, 64])), conv_kernel=draw(st.integers(2, 5)))
        kw["layers_block_type"] = draw(st.lists(st.sampled_from(list(NEMOTRON)), min_size=n, max_size=n).filter(
            lambda t: any(x in ("linear_attention", "full_attention") for x in t)))
        if draw(st.booleans()):
            kw["mamba_ssm_cache_dtype"] = draw(st.sampled_from(DTYPES))
        cls, arch = "NemotronHConfig", "NemotronHForCausalLM"
    else:
        mamba_heads = draw(st.sampled_from([1, 2, 4, 8]))
        kw.update(num_hidden_layers=n, mamba_n_heads=mamba_heads, mamba_n_groups=draw(st.integers(1, 3)),
                  mamba_d_state=draw(st.sampled_from([8, 16, 32])), mamba_d_conv=draw(st.integers(2, 5)))
        if family == "granitemoehybrid":
            if draw(st.booleans()):
                kw["layer_types"] = draw(st.lists(st.sampled_from(["mamba", "attention", "linear_attention"]),
                                                  min_size=n, max_size=n))
            cls, arch = "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"
        else:
            kw["mamba_d_ssm"] = mamba_heads * draw(st.sampled_from([4, 8]))
            cls, arch = "FalconH1Config", "FalconH1ForCausalLM"
    return {"architectures": [arch], **kw}, kw, cls


def theirs(kw, cls):
    """(per-layer kinds, conv shape, ssm shape, ssm dtype or None) from transformers' config class."""
    args = {k: v for k, v in kw.items() if k != "torch_dtype"}
    hf = getattr(transformers, cls)(**args)
    if cls == "NemotronHConfig":
        kinds = [NEMOTRON[t] for t in hf.layers_block_type]
        inter, groups, state, heads, head = (hf.mamba_num_heads * hf.mamba_head_dim, hf.n_groups, hf.ssm_state_size,
                                             hf.mamba_num_heads, hf.mamba_head_dim)
        kernel, ssm = hf.conv_kernel, hf.mamba_ssm_cache_dtype
    elif cls == "FalconH1Config":
        kinds = ["hybrid"] * hf.num_hidden_layers
        inter, groups, state, heads, head = hf.mamba_d_ssm, hf.mamba_n_groups, hf.mamba_d_state, hf.mamba_n_heads, \
            hf.mamba_d_head
        kernel, ssm = hf.mamba_d_conv, None
    elif cls == "GraniteMoeHybridConfig":
        kinds = [{"linear_attention": "linear", "full_attention": "full"}[t] for t in hf.layer_types]
        inter, groups, state, heads, head = hf.mamba_expand * hf.hidden_size, hf.mamba_n_groups, hf.mamba_d_state, \
            hf.mamba_n_heads, hf.mamba_d_head
        kernel, ssm = hf.mamba_d_conv, None
    else:  # Gated DeltaNet
        kinds = [{"linear_attention": "linear", "full_attention": "full"}[t] for t in hf.layer_types]
        k_heads, v_heads, k_dim, v_dim = (hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                                          hf.linear_value_head_dim)
        conv = (hf.linear_conv_kernel_dim - 1, 2 * k_heads * k_dim + v_heads * v_dim)
        return kinds, conv, (v_heads, v_dim, k_dim), getattr(hf, "mamba_ssm_dtype", None)
    return kinds, (kernel - 1, inter + 2 * groups * state), (heads, head, state), ssm


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state_configs(), st.sampled_from([1, 4, 16, 32, 48]), st.sampled_from([None, "fp8", "float32"]),
       st.integers(1, 100_000))
def test_random_state_configs(drawn, block_size, kv_dtype, max_model_len):
    config, kw, cls = drawn
    m = model_layers(config, block_size=block_size, dtype=kv_dtype)

    kinds, conv, ssm, ssm_dtype = theirs(kw, cls)
    assert [k.kind for k in m.kinds] == kinds
    model_dtype = config.get("torch_dtype", "bfloat16")
    for s in m.state_specs:
        assert s.shapes == (conv, ssm)
        assert s.dtypes == (model_dtype, ssm_dtype or model_dtype)

    # one page for every cache; the smallest aligned block that holds the largest state
    pages = {s.page_size_bytes for s in m.specs}
    assert len(pages) == 1
    assert all(s.block_size == m.block_size for s in m.specs)
    states = m.state_specs
    if states and m.attention_specs:
        per_token = m.attention_specs[0].page_size_bytes // m.block_size
        step = lcm(16, block_size)
        assert m.block_size % step == 0 and m.block_size >= block_size
        for s in states:
            assert 0 <= s.padding_bytes
            if m.block_size > block_size:
                assert s.padding_bytes < step * per_token
        largest = max(s.real_page_size_bytes for s in states)
        assert m.block_size == max(block_size, step * cdiv(largest, step * per_token))
    for s in states:
        assert s.max_num_blocks(max_model_len, 2048) == min(2, cdiv(max_model_len, m.block_size))
        assert s.real_page_size_bytes == sum(prod(sh) * dtype_bytes(d) for sh, d in zip(s.shapes, s.dtypes))

    # every cache of every layer in exactly one group, in both layouts; all-full keeps the states
    plan = plan_memory(m, 2**40, max_model_len)
    want = sorted(cache_name(i, s) for i, s in zip(m.cache_layers, m.specs))
    for layout in (plan.hybrid, plan.full):
        groups = layout.kv_cache_config.groups
        assert sorted(n for g in groups for n in g.layer_names) == want
        assert all(isinstance(g.spec, StateSpec) == all(n.endswith(".state") for n in g.layer_names) for g in groups)
    assert all(isinstance(g.spec, (FullAttentionSpec, StateSpec)) for g in plan.full.kv_cache_config.groups)
    full_states = [g.spec for g in plan.full.grouping.groups if isinstance(g.spec, StateSpec)]
    assert set(full_states) == set(states)
    request = plan.hybrid.grouping.request_bytes(max_model_len)
    assert request.state == sum(s.max_memory_usage_bytes(max_model_len, 2048) for s in states)
    kv = [s for s in m.specs if isinstance(s, KVCacheSpec)]
    assert request.kv == sum(s.max_memory_usage_bytes(max_model_len, 2048) for s in kv)

    d = plan_to_dict(plan)
    assert json.loads(json.dumps(d)) == d
    assert len(d["model"]["layer_types"]) == m.num_layers
    render_plan(plan)
