"""Qwen2 (``Qwen2ForCausalLM``): Llama with q/k/v bias and optional sliding layers.

HF 5.24 ``Qwen2Config``: ``sliding_window`` counts only when
``use_sliding_window`` is true; ``layer_types`` defaults to ``"sliding_attention"``
for layers ``i >= max_window_layers`` (the *upper* layers) and full below. A saved
config.json carries ``layer_types`` explicitly, which wins. The planner reads this
(:mod:`hybridkv.planner.architectures`); the model builds what it says.
"""

from __future__ import annotations

from hybridkv.engine.models.llama import LlamaForCausalLM

__all__ = ["Qwen2ForCausalLM"]


class Qwen2ForCausalLM(LlamaForCausalLM):
    family = "qwen2"

    def _qkv_bias(self) -> tuple[bool, bool]:
        return True, False
