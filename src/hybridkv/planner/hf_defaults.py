"""transformers 5.24's config defaults, one table per family, for keys a ``config.json`` omits.

Public configs leave out what their config class defaults: google/gemma-3-4b-it's
``text_config`` has no ``num_attention_heads``, ``num_key_value_heads`` nor ``head_dim``
(transformers reads 8, 4 and 256 from ``Gemma3TextConfig``). The planner and the engine
fill an absent key from these tables, so both read the model transformers builds.
Copied from the dataclass fields of each class in ``transformers/models/*/configuration_*.py``
(transformers is never imported at run time); ``tests/planner`` compares them with the
installed transformers.

Two keys are left out on purpose and stay required: ``num_hidden_layers`` and
``hidden_size``. A config without them describes no particular model, and planning
the class default's 26 or 48 layers would silently plan another one. Token ids
(``eos_token_id`` and friends) are left out too: generation stops where ``config.json``
and ``generation_config.json`` say.

A key present with the value ``null`` is not absent: it keeps its meaning
(``sliding_window: null`` turns the window off, ``num_key_value_heads: null`` means
one KV head per query head, ``head_dim: null`` means ``hidden_size // num_attention_heads``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["TEXT_DEFAULTS", "MULTIMODAL_DEFAULTS", "DEFAULT_MAX_POSITION_EMBEDDINGS"]

#: the context the engine runs when a config states no ``max_position_embeddings``
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048

#: Qwen3-Next / Qwen3.5's Gated DeltaNet fields (equal in the three classes)
_GATED_DELTA_NET: dict[str, Any] = {
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}

_TEXT: dict[str, dict[str, Any]] = {
    # LlamaConfig
    "llama": {
        "vocab_size": 32000, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": None,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    },
    # MistralConfig (no attention_bias / mlp_bias fields: the model has no biases)
    "mistral": {
        "vocab_size": 32000, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "sliding_window": 4096,
    },
    # Qwen2Config (no head_dim field: hidden_size // num_attention_heads)
    "qwen2": {
        "vocab_size": 151936, "intermediate_size": 22016, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    },
    # Qwen3Config
    "qwen3": {
        "vocab_size": 151936, "intermediate_size": 22016, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28,
    },
    # Gemma3TextConfig (sliding_window_pattern: read from kwargs in __post_init__, default 6)
    "gemma3": {
        "vocab_size": 262_208, "intermediate_size": 9216, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "sliding_window_pattern": 6, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "use_bidirectional_attention": False,
    },
    # Llama4TextConfig
    "llama4": {
        "vocab_size": 202048, "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_experts_per_tok": 1, "num_local_experts": 16,
        "moe_layers": None, "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layers": None,
        "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "attn_temperature_tuning": True,
        "floor_scale": 8192, "attn_scale": 0.1, "attention_bias": False,
    },
    # GptOssConfig
    "gpt_oss": {
        "vocab_size": 201088, "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
    },
    # Qwen3NextConfig (full_attention_interval: read from kwargs in __post_init__, default 4)
    "qwen3_next": {
        "vocab_size": 151936, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "full_attention_interval": 4, **_GATED_DELTA_NET,
    },
    # Qwen3_5TextConfig (Qwen3.5 dense; full_attention_interval as Qwen3-Next)
    "qwen3_5": {
        "vocab_size": 248320, "intermediate_size": 12288, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "full_attention_interval": 4, **_GATED_DELTA_NET,
    },
    # Qwen3_5MoeTextConfig
    "qwen3_5_moe": {
        "vocab_size": 248320, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "hidden_act": "silu", "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "full_attention_interval": 4, **_GATED_DELTA_NET,
    },
    # NemotronHConfig (the layer list has no default here: it sets the layer count)
    "nemotron_h": {
        "vocab_size": 131072, "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 4096, "tie_word_embeddings": False, "ssm_state_size": 128,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "conv_kernel": 4, "expand": 2,
        "mamba_ssm_cache_dtype": "float32",
    },
    # GraniteMoeHybridConfig (no head_dim field: hidden_size // num_attention_heads)
    "granitemoehybrid": {
        "vocab_size": 32000, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": None,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
        "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2,
    },
    # FalconH1Config (no head_dim field: the model reads getattr(config, "head_dim") or hidden // heads)
    "falcon_h1": {
        "vocab_size": 128000, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": "auto",
        "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2,
    },
}

#: family name -> {key: transformers' default} of its text config class
TEXT_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: MappingProxyType(table) for name, table in _TEXT.items()}
)

#: family name -> the defaults of its multimodal wrapper (Gemma3Config, Llama4Config) that
#: the language model reads: transformers ties ``lm_head`` by the *top-level* flag
MULTIMODAL_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "gemma3": MappingProxyType({"tie_word_embeddings": True}),
    "llama4": MappingProxyType({"tie_word_embeddings": False}),
    "qwen3_5": MappingProxyType({"tie_word_embeddings": False}),
    "qwen3_5_moe": MappingProxyType({"tie_word_embeddings": False}),
})
