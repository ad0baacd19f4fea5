"""Tiny random Qwen3-Next / Qwen3.5 checkpoints (fp32, no downloads), for the model's and the engine's tests.

Built with transformers' own classes, the weights re-drawn larger than HF's init so every
path matters (zero-centred norms near 0, the gated norm near 1), saved with
``save_pretrained`` and no EOS (HF and the engine run every token).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, max_position_embeddings=512,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
LINEAR, FULL = "linear_attention", "full_attention"

#: name -> (transformers config class, model class, config keys)
CONFIGS = {
    # last layer linear (the output rows are picked after a linear layer); a dense MLP on layer 2
    "linear_last": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                    dict(**MOE, layer_types=[LINEAR, FULL, LINEAR, LINEAR], mlp_only_layers=[2])),
    # layer types from full_attention_interval; MoE on odd layers only; biases; no top-k renormalising
    "interval": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                 dict(**MOE, num_hidden_layers=4, full_attention_interval=2, decoder_sparse_step=2,
                      attention_bias=True, norm_topk_prob=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})),
    # Qwen3.5: split projections, dense MLPs; Qwen3.5-MoE: every layer MoE
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(layer_types=[LINEAR, FULL, LINEAR])),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(**MOE, layer_types=[LINEAR, LINEAR, FULL])),
}


def redraw(model: torch.nn.Module, seed: int) -> None:
    """Larger weights than HF's init (so every path matters); zero-centred norms near 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif p.ndim == 1:  # zero-centred norms, A_log, dt_bias, biases
                p.copy_(0.3 * noise)
            else:
                fan_in = p.shape[-1] if p.ndim == 2 else p.shape[-2]
                p.copy_(noise * (1.5 / fan_in**0.5))


def build_qwen3_next(name: str, path: Path, seed: int = 0):
    """Make, re-draw and save model ``name`` (a :data:`CONFIGS` key) under ``path``; the HF model (eval)."""
    config_cls, model_cls, extra = CONFIGS[name]
    kw = {**COMMON, **extra}
    if "moe" in name:  # Qwen3_5MoeTextConfig has no dense MLP size
        kw.pop("intermediate_size")
    kw.setdefault("num_hidden_layers", len(kw.get("layer_types", [])))
    config = getattr(tf, config_cls)(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = getattr(tf, model_cls)(config).eval()
    redraw(hf, seed)
    hf.config.eos_token_id = None
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(path)
    return hf
