"""Qwen2 (``Qwen2ForCausalLM``): Llama with q/k/v bias and optional sliding layers.

HF 5.24 ``Qwen2Config``: ``sliding_window`` counts only when
``use_sliding_window`` is true; ``layer_types`` defaults to ``"sliding_attention"``
for layers ``i >= max_window_layers`` (the *upper* layers) and full below. A saved
config.json carries ``layer_types`` explicitly, which wins.
"""

from __future__ import annotations

from typing import Any, Mapping

from hybridkv.engine.attention import FULL, AttentionType
from hybridkv.engine.models.llama import LlamaForCausalLM
from hybridkv.errors import InvalidConfigError

__all__ = ["Qwen2ForCausalLM", "sliding_layer_types"]


def sliding_layer_types(config: Mapping[str, Any], num_layers: int) -> list[AttentionType]:
    """Qwen2's per-layer attention: ``layer_types`` or the ``max_window_layers`` rule."""
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = config.get("max_window_layers", 28)
        layer_types = [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)
        ]
    if len(layer_types) < num_layers:
        raise InvalidConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    out = []
    for i, kind in enumerate(layer_types[:num_layers]):
        if kind == "full_attention":
            out.append(FULL)
        elif kind == "sliding_attention":
            if window is None:
                raise InvalidConfigError(
                    f"layer {i} is sliding_attention but the config has no sliding window "
                    "(Qwen2 honours sliding_window only with use_sliding_window=true)"
                )
            out.append(AttentionType("sliding", int(window)))
        else:
            raise InvalidConfigError(f"layer {i}: unsupported layer type {kind!r}")
    return out


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._types = sliding_layer_types(config, int(config.get("num_hidden_layers") or 0))
        super().__init__(config)

    def attention_type(self, layer_idx: int) -> AttentionType:
        return self._types[layer_idx]

    def _qkv_bias(self) -> tuple[bool, bool]:
        return True, False
