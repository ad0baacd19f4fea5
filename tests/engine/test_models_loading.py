"""Model registry, safetensors loading by HF name, and what each model tells the KV planner."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.engine.models import (
    MODEL_CLASSES,
    Gemma3ForCausalLM,
    Llama4ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    load_model,
    model_class_for,
)
from hybridkv.engine.layers.rope import inv_freq_and_scale
from hybridkv.engine.loading.weights import eos_token_ids
from hybridkv.errors import InvalidConfigError, UnknownArchitectureError, WeightLoadError
from hybridkv.planner.architectures import FAMILIES, model_layers


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
        "qwen3": [("full", None)] + [("sliding", 14)] * 3,
        "gemma3_mm": [("sliding", 12)] * 5 + [("full", None)],  # Gemma3TextConfig's pattern 6
        "llama4_mm": [("chunked", 20)] * 3 + [("full", None)],
    }
    for arch, types in expect.items():
        path, _ = tiny_models(arch)
        model = load_model(path)
        assert model.layer_attention_types() == types, arch
        # the planner reads the same checkpoint the same way
        assert [tuple(k) for k in model_layers(json.loads((path / "config.json").read_text())).kinds] == types, arch


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
    with pytest.raises(InvalidConfigError, match=r"config.json: num_hidden_layers is missing$"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}))
    with pytest.raises(InvalidConfigError, match=r"config.json: hidden_size is missing$"):
        load_model(tmp_path)


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnknownArchitectureError, match="FalconForCausalLM.*LlamaForCausalLM"):
        model_class_for({"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    assert model_class_for({"model_type": "llama4_text"}) is Llama4ForCausalLM
    assert model_class_for({"architectures": ["Qwen2ForCausalLM"]}) is Qwen2ForCausalLM


def _qwen_config(**kw):
    base = dict(hidden_size=32, vocab_size=16, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=8)
    return {**base, **kw}


def test_qwen2_sliding_rules():
    with torch.device("meta"):
        off = Qwen2ForCausalLM(_qwen_config(sliding_window=8, max_window_layers=1))
        on = Qwen2ForCausalLM(_qwen_config(sliding_window=8, max_window_layers=1, use_sliding_window=True))
    assert off.layer_attention_types() == [("full", None)] * 4
    assert on.layer_attention_types() == [("full", None)] + [("sliding", 8)] * 3
    # transformers builds this config, then fails on its first forward; so does the planner, the engine asks it
    with pytest.raises(InvalidConfigError, match="use_sliding_window is false.*transformers cannot run such a layer"):
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


#: families the planner plans but the engine does not run (Mamba-2 hybrids): a clear error
PLAN_ONLY = {"nemotron_h", "granitemoehybrid", "falcon_h1"}


def test_every_planner_family_has_an_engine_class():
    assert sorted(cls.family for cls in MODEL_CLASSES) == sorted(f.name for f in FAMILIES if f.name not in PLAN_ONLY)
    for family in FAMILIES:
        for arch in family.architectures:
            if family.name in PLAN_ONLY:
                with pytest.raises(UnknownArchitectureError):
                    model_class_for({"architectures": [arch]})
                continue
            assert model_class_for({"architectures": [arch]}).family == family.name
    assert model_class_for({"architectures": ["Qwen3ForCausalLM"]}) is Qwen3ForCausalLM
    assert model_class_for({"model_type": "gemma3"}) is Gemma3ForCausalLM


def test_engine_layers_are_the_planners():
    """The engine takes each layer's kind from the planner's parser (one rule for layer_types)."""
    cfg = _qwen_config(num_hidden_layers=5, use_sliding_window=True, sliding_window=6,
                       layer_types=["full_attention", "sliding_attention", "attention", "sliding_attention",
                                    "full_attention"])
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    want = model_layers({"architectures": ["Qwen2ForCausalLM"], **cfg}, block_size=4, dtype="float32")
    assert model.layer_attention_types() == [tuple(k) for k in want.kinds]
    assert model.layer_attention_types() == [("full", None), ("sliding", 6), ("full", None), ("sliding", 6),
                                             ("full", None)]
    assert model.kv_cache_specs(4, "float32") == list(want.specs)
    with pytest.raises(InvalidConfigError, match=r"layer_types\[1\] is 'chunked_attention'; expected one of"):
        with torch.device("meta"):
            Qwen2ForCausalLM({**cfg, "layer_types": ["full_attention", "chunked_attention"] + ["full_attention"] * 3})


def test_gemma3_4b_shaped_config_gets_transformers_defaults(tiny_models):
    """gemma-3-4b-it's text_config omits heads, KV heads, head_dim, query_pre_attn_scalar, rope_parameters."""
    path, hf = tiny_models("gemma3_mm")
    text = json.loads((path / "config.json").read_text())["text_config"]
    assert not {"num_attention_heads", "num_key_value_heads", "head_dim", "query_pre_attn_scalar"} & set(text)
    model = load_model(path)
    hf_text = hf.config.text_config
    assert (model.num_heads, model.num_kv_heads, model.head_dim) == (8, 4, 256) == (
        hf_text.num_attention_heads, hf_text.num_key_value_heads, hf_text.head_dim)
    assert model.model.layers[0].self_attn.scale == 256**-0.5
    assert model.lm_head.weight is model.model.embed_tokens.weight  # Gemma3Config ties by default
    # old-format rope_scaling (linear, factor 8) on the full layers only, default thetas 1e6 / 1e4
    default = {"rope_type": "default"}
    full = inv_freq_and_scale({**default, "rope_theta": 1e6}, 256, 1)[0] / 8
    local = inv_freq_and_scale({**default, "rope_theta": 1e4}, 256, 1)[0]
    assert torch.allclose(model.rotaries["full_attention"].inv_freq, full)
    assert torch.equal(model.rotaries["sliding_attention"].inv_freq, local)


def _relayout(src, dst, renames):
    """Copy checkpoint ``src`` to ``dst`` with its tensor names rewritten by ``renames`` (prefix pairs)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, tensor in weights.items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = tensor
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("arch", ["gemma3_mm", "llama4_mm"])
def test_multimodal_checkpoint_layouts_load_the_same(arch, tiny_models, tmp_path):
    """transformers 5.24 writes ``language_model.model.*`` (checked here); 4.52-4.57 wrote
    ``model.language_model.*`` with ``lm_head`` and the vision tower under ``model.``: both load."""
    path, _ = tiny_models(arch)
    names = set(load_file(str(path / "model.safetensors")))
    assert any(n.startswith("language_model.model.layers.0.") for n in names)
    assert any(n.startswith(("vision_tower.", "vision_model.")) for n in names)
    assert ("language_model.lm_head.weight" in names) == (arch == "llama4_mm")  # Gemma 3 ties it
    new = _relayout(path, tmp_path / "new", [
        ("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."), ("vision_model.", "model.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ])
    a, b = load_model(path).state_dict(), load_model(new).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_multimodal_checkpoint_problems_are_named(tiny_models, tmp_path):
    bad = _copy(tiny_models, "llama4_mm", tmp_path)
    _edit_weights(bad, lambda w: (w.pop("language_model.model.norm.weight"),
                                  w.update({"language_model.model.extra.weight": torch.zeros(2)})))
    with pytest.raises(WeightLoadError, match=r"unknown tensors: language_model.model.extra.weight; "
                                              r"missing tensors: model.norm.weight$"):
        load_model(bad)
    twice = _copy(tiny_models, "llama4_mm", tmp_path / "twice")
    norm = "language_model.model.norm.weight"
    _edit_weights(twice, lambda w: w.update({"model.language_model.norm.weight": w[norm].clone()}))
    with pytest.raises(WeightLoadError, match="tensors stored twice: "):
        load_model(twice)


def test_multimodal_config_errors_name_the_nested_key(tiny_models, tmp_path):
    path = _copy(tiny_models, "llama4_mm", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["attention_chunk_size"] = None  # layer_types still says chunked_attention
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidConfigError, match=r"config.json: layer 0 is chunked_attention \(layer_types\) but "
                                                 r"text_config.attention_chunk_size is null"):
        load_model(path)


def test_vision_tensors_are_only_skipped_in_multimodal_checkpoints(tiny_models, tmp_path):
    path = _copy(tiny_models, "llama4_dense", tmp_path)
    _edit_weights(path, lambda w: w.update({"vision_model.class_embedding": torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match="unknown tensors: vision_model.class_embedding"):
        load_model(path)


def test_multimodal_eos_and_tie_come_from_the_top_level():
    text = dict(hidden_size=32, vocab_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=8,
                num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    top = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "text_config": text}
    with torch.device("meta"):
        tied = Gemma3ForCausalLM(top)
        untied = Gemma3ForCausalLM({**top, "tie_word_embeddings": False})
    assert tied.tie_word_embeddings and not untied.tie_word_embeddings  # transformers ties by the top-level flag
    assert tied.eos_token_ids == (1, 106)


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
