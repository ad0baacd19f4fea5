"""Model registry, safetensors loading by HF name, and what each model tells the KV planner."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.engine.attention import FULL, AttentionType
from hybridkv.engine.models import Llama4ForCausalLM, Qwen2ForCausalLM, load_model, model_class_for
from hybridkv.engine.models.base import attention_types
from hybridkv.engine.models.weights import eos_token_ids
from hybridkv.errors import InvalidConfigError, UnknownArchitectureError, WeightLoadError


def _copy(tiny_models, arch, tmp_path):
    src, _ = tiny_models(arch)
    dst = tmp_path / arch
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path, fn):
    weights = load_file(str(path / "model.safetensors"))
    fn(weights)
    save_file(weights, str(path / "model.safetensors"))


def test_layer_attention_types_per_family(tiny_models):
    expect = {
        "llama": [("full", None)] * 4,
        "llama4_dense": [("chunked", 20)] * 3 + [("full", None)] + [("chunked", 20)] * 2,
        "llama4_moe": [("chunked", 16)] * 3 + [("full", None)],
        "gemma3": [("sliding", 12), ("sliding", 12), ("full", None)] * 2,
        "mistral": [("sliding", 10)] * 4,
        "qwen2": [("full", None)] * 2 + [("sliding", 16)] * 2,  # layers >= max_window_layers slide
        "gpt_oss": [("sliding", 12), ("full", None)] * 2,
    }
    for arch, types in expect.items():
        path, _ = tiny_models(arch)
        assert load_model(path).layer_attention_types() == types, arch


def test_kv_cache_specs(tiny_models):
    model = load_model(tiny_models("llama4_dense")[0])
    specs = model.kv_cache_specs(block_size=8, dtype="float32")
    assert isinstance(specs[3], FullAttentionSpec)
    assert specs[0] == ChunkedLocalAttentionSpec(
        block_size=8, num_kv_heads=2, head_size=16, dtype="float32", attention_chunk_size=20
    )
    gemma = load_model(tiny_models("gemma3")[0]).kv_cache_specs(4)
    assert isinstance(gemma[0], SlidingWindowSpec) and gemma[0].sliding_window == 12


def test_sharded_checkpoint_loads_the_same(tiny_models, tmp_path):
    path, hf = tiny_models("llama4_moe")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    a, b = load_model(path), load_model(tmp_path)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)


def test_tied_embeddings_need_no_lm_head(tiny_models):
    path, _ = tiny_models("gemma3")
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_tensor_is_named(tiny_models, tmp_path):
    path = _copy(tiny_models, "llama", tmp_path)
    _edit_weights(path, lambda w: (w.pop("model.layers.2.mlp.up_proj.weight"), w.pop("lm_head.weight")))
    with pytest.raises(WeightLoadError, match="missing tensors: lm_head.weight, model.layers.2.mlp.up_proj.weight"):
        load_model(path)


def test_unknown_tensor_is_named(tiny_models, tmp_path):
    path = _copy(tiny_models, "gpt_oss", tmp_path)
    _edit_weights(path, lambda w: w.update({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match="unknown tensors: model.layers.0.mlp.experts.gate_up_proj_blocks"):
        load_model(path)


def test_misshaped_tensor_is_named(tiny_models, tmp_path):
    path = _copy(tiny_models, "qwen2", tmp_path)
    _edit_weights(path, lambda w: w.update({"model.layers.1.self_attn.q_proj.bias": torch.zeros(3)}))
    with pytest.raises(WeightLoadError, match=r"misshaped tensors: model.layers.1.self_attn.q_proj.bias \(3,\)"):
        load_model(path)


def test_no_weights_or_config(tmp_path):
    with pytest.raises(InvalidConfigError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(InvalidConfigError, match="hidden_size"):
        load_model(tmp_path)


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnknownArchitectureError, match="FalconForCausalLM.*LlamaForCausalLM"):
        model_class_for({"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    assert model_class_for({"model_type": "llama4_text"}) is Llama4ForCausalLM
    assert model_class_for({"architectures": ["Qwen2ForCausalLM"]}) is Qwen2ForCausalLM


def _qwen_config(**kw):
    base = dict(hidden_size=32, vocab_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=8)
    return {**base, **kw}


def test_qwen2_sliding_rules():
    with torch.device("meta"):
        off = Qwen2ForCausalLM(_qwen_config(sliding_window=8, max_window_layers=1))
        on = Qwen2ForCausalLM(_qwen_config(sliding_window=8, max_window_layers=1, use_sliding_window=True))
    assert off.layer_attention_types() == [("full", None)] * 4
    assert on.layer_attention_types() == [("full", None)] + [("sliding", 8)] * 3
    with pytest.raises(InvalidConfigError, match="use_sliding_window"):
        Qwen2ForCausalLM(_qwen_config(sliding_window=8, layer_types=["sliding_attention"] * 4))


def test_llama4_defaults_follow_hf():
    cfg = _qwen_config(num_hidden_layers=8, attention_chunk_size=32, intermediate_size_mlp=8, num_local_experts=2)
    with torch.device("meta"):
        model = Llama4ForCausalLM(cfg)
    # no_rope_layers default: every 4th layer NoPE -> full; moe_layers default: every layer
    assert model.layer_attention_types() == ([("chunked", 32)] * 3 + [("full", None)]) * 2
    assert model.moe_layers == set(range(8))
    with torch.device("meta"):
        dense = Llama4ForCausalLM({**cfg, "moe_layers": []})
    assert dense.moe_layers == set()


def test_attention_types_from_layer_types():
    names = ["sliding_attention", "full_attention", "chunked_attention"]
    assert attention_types(names, 3, "X", sliding_window=4, attention_chunk_size=8) == [
        AttentionType("sliding", 4), FULL, AttentionType("chunked", 8)
    ]
    with pytest.raises(InvalidConfigError, match="layer 2: unsupported X layer type 'chunked_attention'"):
        attention_types(names, 3, "X", sliding_window=4)
    with pytest.raises(InvalidConfigError, match=r"layer 0 is sliding_attention but the config has no sliding_window \(why\)"):
        attention_types(names, 3, "X", hint=" (why)", sliding_window=None, attention_chunk_size=8)
    with pytest.raises(InvalidConfigError, match="layer_types has 3 entries for 4 layers"):
        attention_types(names, 4, "X", sliding_window=4, attention_chunk_size=8)


def test_decoder_layers_keep_hf_names(tiny_models):
    llama4 = load_model(tiny_models("llama4_dense")[0])
    gemma = load_model(tiny_models("gemma3")[0])
    assert sorted(n for n, _ in llama4.model.layers[0].named_children()) == [
        "feed_forward", "input_layernorm", "post_attention_layernorm", "self_attn"
    ]
    assert sorted(n for n, _ in gemma.model.layers[0].named_children()) == [
        "input_layernorm", "mlp", "post_attention_layernorm", "post_feedforward_layernorm",
        "pre_feedforward_layernorm", "self_attn",
    ]


def test_eos_token_ids_from_config_and_generation_config(tmp_path):
    assert eos_token_ids({"eos_token_id": 2}) == (2,)
    assert eos_token_ids({"eos_token_id": [1, 106]}) == (1, 106)
    assert eos_token_ids({"eos_token_id": None}, tmp_path) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [106, 7]}))
    assert eos_token_ids({"eos_token_id": [1, 106]}, tmp_path) == (1, 106, 7)
    with pytest.raises(InvalidConfigError, match="config.json: eos_token_id must be a non-negative int"):
        eos_token_ids({"eos_token_id": "2"})
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(InvalidConfigError, match="generation_config.json: not valid JSON"):
        eos_token_ids({}, tmp_path)


def test_loaded_model_knows_its_eos(tiny_models, tmp_path):
    path = _copy(tiny_models, "mistral", tmp_path)
    assert load_model(path).eos_token_ids == ()  # the tiny models are saved without one
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_model(path).eos_token_ids == (5,)
