"""Cross-check: our per-layer attention types equal what transformers' config classes derive."""

import pytest

from hybridkv.core.specs import ChunkedLocalAttentionSpec, SlidingWindowSpec
from hybridkv.planner.architectures import model_layers
from hybridkv.planner.presets import load_model_config

transformers = pytest.importorskip("transformers")

CLASSES = {
    "llama4": "Llama4TextConfig",
    "gemma3": "Gemma3TextConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gpt_oss": "GptOssConfig",
    "llama": "LlamaConfig",
}


def ours(config):
    out = []
    for s in model_layers(config).specs:
        if isinstance(s, SlidingWindowSpec):
            out.append(("sliding", s.sliding_window))
        elif isinstance(s, ChunkedLocalAttentionSpec):
            out.append(("chunked", s.attention_chunk_size))
        else:
            out.append(("full", None))
    return out


def theirs(config):
    family = model_layers(config).family
    text = dict(config.get("text_config", config))
    for key in ("architectures", "model_type", "text_config"):
        text.pop(key, None)
    hf = getattr(transformers, CLASSES[family])(**text)
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    if family == "mistral":  # MistralModel: one window for every layer, layer_types unused
        types = ["sliding_attention"] * hf.num_hidden_layers
    if types is None:
        types = ["full_attention"] * hf.num_hidden_layers
    out = []
    for t in types:
        if t == "chunked_attention":
            out.append(("chunked", hf.attention_chunk_size))
        elif t == "sliding_attention" and window is not None:
            out.append(("sliding", window))
        else:
            out.append(("full", None))
    return out, hf.head_dim if getattr(hf, "head_dim", None) else hf.hidden_size // hf.num_attention_heads


def base(arch, **kw):
    return {"architectures": [arch], "num_hidden_layers": 8, "num_attention_heads": 4, "hidden_size": 256, **kw}


CASES = {
    **{name: load_model_config(name).config for name in
       ("llama4-scout", "gemma-3-27b", "mistral-7b", "gpt-oss-20b", "llama-3.1-8b")},
    "llama4-explicit-rope": {"architectures": ["Llama4ForCausalLM"], "text_config": base(
        "x", num_key_value_heads=2, head_dim=64, no_rope_layers=[1, 0, 1, 1, 0, 0, 1, 1], attention_chunk_size=128)},
    "llama4-interval-3": base("Llama4ForCausalLM", num_key_value_heads=2, head_dim=64, no_rope_layer_interval=3),
    "gemma3-pattern-3": base("Gemma3ForCausalLM", num_key_value_heads=1, head_dim=64, sliding_window_pattern=3,
                             sliding_window=512),
    "qwen2-no-sliding": base("Qwen2ForCausalLM", num_key_value_heads=2, sliding_window=64, max_window_layers=3),
    "qwen2-sliding": base("Qwen2ForCausalLM", num_key_value_heads=2, sliding_window=64, max_window_layers=3,
                          use_sliding_window=True),
    "qwen3-sliding-types": base("Qwen3ForCausalLM", num_key_value_heads=2, use_sliding_window=True,
                                sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 4),
    "gpt-oss-derived": base("GptOssForCausalLM", num_key_value_heads=2, head_dim=64),
    "mistral-null-window": base("MistralForCausalLM", num_key_value_heads=2, sliding_window=None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layer_types_match_transformers(name):
    config = CASES[name]
    expected, head_dim = theirs(config)
    assert ours(config) == expected
    assert model_layers(config).head_dim == head_dim
