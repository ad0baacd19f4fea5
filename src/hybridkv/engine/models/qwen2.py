"""Qwen2 (``Qwen2ForCausalLM``): Llama with q/k/v bias and optional sliding layers.

HF 5.24 ``Qwen2Config``: ``sliding_window`` counts only when
``use_sliding_window`` is true; ``layer_types`` defaults to ``"sliding_attention"``
for layers ``i >= max_window_layers`` (the *upper* layers) and full below. A saved
config.json carries ``layer_types`` explicitly, which wins.
"""

from __future__ import annotations

from typing import Any, Mapping

from hybridkv.engine.attention import AttentionType
from hybridkv.engine.models.base import attention_types
from hybridkv.engine.models.llama import LlamaForCausalLM

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
    hint = " (Qwen2 honours sliding_window only with use_sliding_window=true)"
    return attention_types(layer_types, num_layers, "Qwen2", hint=hint, sliding_window=window)


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)

    def _layer_types(self, config: Mapping[str, Any]) -> list[AttentionType]:
        return sliding_layer_types(config, self.num_layers)

    def _qkv_bias(self) -> tuple[bool, bool]:
        return True, False
