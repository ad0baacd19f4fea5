"""Mistral (``MistralForCausalLM``): Llama with every layer sliding when set.

HF 5.24 ``MistralModel`` builds one mask for all layers:
``create_sliding_window_causal_mask`` when ``config.sliding_window`` is not None
(key k visible from query p iff ``p - W < k <= p``), else the causal mask. Mistral
ignores ``layer_types`` (HF warns and uses the single mask); the planner reads it so.
"""

from __future__ import annotations

from hybridkv.engine.models.llama import LlamaForCausalLM

__all__ = ["MistralForCausalLM"]


class MistralForCausalLM(LlamaForCausalLM):
    family = "mistral"

    def _qkv_bias(self) -> tuple[bool, bool]:
        return False, False
