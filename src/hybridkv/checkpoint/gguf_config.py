"""GGUF metadata -> the HF ``config.json``-shaped dict transformers 5.24 builds from the same file.

transformers reads ``{arch}.block_count`` as ``num_hidden_layers`` and so on
(``integrations/ggml.py``'s ``GGUF_CONFIG_MAPPING``), then fills every key the file
lacks from the config class's defaults. This module does the same renaming, one table
per architecture, and writes out the defaults that decide the model's maths, so the
planner and the engine read the model transformers runs. For Gemma 3 270M::

    gemma3.block_count 18, gemma3.attention.sliding_window 512, gemma3.rope.freq_base 1e6
    -> num_hidden_layers 18, sliding_window 512,
       layer_types: every 6th layer "full_attention", the others "sliding_attention"
       (Gemma3TextConfig's sliding_window_pattern 6; llama.cpp hard-codes the same 6),
       rope_parameters: full_attention theta 1e6, sliding_attention theta 10000 (the class default;
       llama.cpp hard-codes it too), query_pre_attn_scalar 256, final_logit_softcapping None

Where a file says more than transformers reads, the file wins: a ``{arch}.rope.scaling.*``
entry becomes the rope scaling (transformers ignores it for gemma3). Known differences from
transformers' config, on purpose: ``architectures`` is set (transformers leaves it null);
``eos_token_id`` lists ``tokenizer.ggml.eot_token_id`` after the EOS id when the file has
one (the ids HF's ``generation_config.json`` stops at for such models).

``tie_word_embeddings``: true when the file has no ``output.weight`` (llama.cpp drops a tied head).
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

from hybridkv.errors import GGUFFormatError, UnknownArchitectureError

__all__ = ["hf_config_from_gguf", "SUPPORTED_GGUF_ARCHITECTURES", "gguf_eos_token_ids"]

# GGUF key (after "{arch}.") -> HF key; shared by every supported architecture
_COMMON = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


class _Arch:
    """One GGUF architecture: its HF names, extra key renames and the defaults written out."""

    def __init__(self, architecture: str, model_type: str, keys: Mapping[str, str], defaults: Mapping[str, Any]):
        self.architecture = architecture
        self.model_type = model_type
        self.keys = {**_COMMON, **keys}
        self.defaults = dict(defaults)


#: GGUF ``general.architecture`` -> how transformers builds its config
_ARCHS: dict[str, _Arch] = {
    # llama.cpp writes rope.dimension_count = head_dim; transformers reads it as head_dim
    "llama": _Arch("LlamaForCausalLM", "llama", {"rope.dimension_count": "head_dim"},
                   {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", {}, {"hidden_act": "silu", "use_sliding_window": False}),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", {"attention.key_length": "head_dim"},
                   {"hidden_act": "silu", "use_sliding_window": False, "attention_bias": False}),
    "gemma3": _Arch(
        "Gemma3ForCausalLM", "gemma3_text",
        {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window",
         "final_logit_softcapping": "final_logit_softcapping", "attn_logit_softcapping": "attn_logit_softcapping"},
        {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "attention_bias": False,
         "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False},
    ),
}
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_ARCHS))

#: Gemma3TextConfig's (and llama.cpp's) layer pattern and local rope base
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10_000.0
_GEMMA3_GLOBAL_THETA = 1_000_000.0
_DEFAULT_THETA = 10_000.0


def _int(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFFormatError(f"GGUF metadata {key!r} must be an integer, got {value!r}")
    return value


def gguf_eos_token_ids(metadata: Mapping[str, Any]) -> list[int]:
    """``tokenizer.ggml.eos_token_id``, then ``tokenizer.ggml.eot_token_id`` if the file has another."""
    ids = [_int(metadata, "tokenizer.ggml.eos_token_id"), _int(metadata, "tokenizer.ggml.eot_token_id")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _rope_scaling(metadata: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    """``{arch}.rope.scaling.type`` / ``.factor`` as an HF rope dict (None when absent or "none")."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if not kind or kind == "none":
        return None
    out: dict[str, Any] = {"rope_type": "default" if kind == "none" else str(kind)}
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if factor is not None:
        out["factor"] = float(factor)
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    return out


def _gemma3_layout(config: dict[str, Any], metadata: Mapping[str, Any]) -> None:
    """layer_types and the two rotaries of Gemma 3 (see the module docstring)."""
    n = config["num_hidden_layers"]
    config["layer_types"] = [
        "full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention" for i in range(n)
    ]
    full = {"rope_type": "default", "rope_theta": float(metadata.get("gemma3.rope.freq_base", _GEMMA3_GLOBAL_THETA))}
    full.update(_rope_scaling(metadata, "gemma3") or {})
    local_theta = metadata.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_THETA)
    config["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": float(local_theta)},
        "full_attention": full,
    }


def hf_config_from_gguf(metadata: Mapping[str, Any], tensor_names: Collection[str] | None = None) -> dict[str, Any]:
    """The HF config dict of a GGUF file's ``metadata`` (plain values, as GGUFFile.metadata).

    ``tensor_names``: the file's tensors, for ``tie_word_embeddings`` (no ``output.weight``:
    tied); None leaves the key to the family's default. Raises UnknownArchitectureError
    for an architecture outside :data:`SUPPORTED_GGUF_ARCHITECTURES`, GGUFFormatError for
    a missing or mistyped required key.
    """
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFFormatError("GGUF metadata has no general.architecture string")
    spec = _ARCHS.get(arch)
    if spec is None:
        raise UnknownArchitectureError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    config: dict[str, Any] = {"architectures": [spec.architecture], "model_type": spec.model_type, **spec.defaults}
    for key, hf_key in spec.keys.items():
        value = metadata.get(f"{arch}.{key}")
        if value is not None:
            config[hf_key] = value
    for key in ("num_hidden_layers", "hidden_size"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            gguf_key = next(k for k, v in spec.keys.items() if v == key)
            raise GGUFFormatError(f"GGUF metadata {arch}.{gguf_key} must be a positive integer, got {value!r}")
    if "vocab_size" not in config:  # as transformers: the tokenizer's size
        tokens = metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            config["vocab_size"] = len(tokens)
    if "rms_norm_eps" in config:
        config["rms_norm_eps"] = float(config["rms_norm_eps"])
    for key, hf_key in _TOKEN_IDS.items():
        value = _int(metadata, key)
        if value is not None:
            config[hf_key] = value
    eos = gguf_eos_token_ids(metadata)
    if len(eos) > 1:
        config["eos_token_id"] = eos
    if tensor_names is not None:
        config["tie_word_embeddings"] = "output.weight" not in tensor_names
    if arch == "gemma3":
        _gemma3_layout(config, metadata)
    else:
        rope = {"rope_type": "default", "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", _DEFAULT_THETA))}
        rope.update(_rope_scaling(metadata, arch) or {})
        config["rope_parameters"] = rope
    name = metadata.get("general.name")
    if isinstance(name, str):
        config["_model_name_or_path"] = name
    return config
