"""Tiny random HF models for parity tests, built from configs (no downloads).

Each model is made with transformers (fp32, fixed seed), its weights re-drawn
larger than HF's init (std 0.02 makes attention nearly uniform and would hide
mask bugs), norm weights / biases / sinks perturbed so every tensor matters, then
saved with ``save_pretrained`` (safetensors) for our loader.

The multimodal ones (``*_mm``) are transformers' own ``...ForConditionalGeneration``
classes with a tiny vision tower, so the checkpoint has the weight names and nested
``text_config`` transformers writes. ``gemma3_mm`` then has its config cut down to the
keys google/gemma-3-4b-it's ``text_config`` carries (no heads, head_dim, rope_parameters,
layer_types, ...) and is reloaded by transformers from that file, so both sides read
transformers' defaults for the rest.
"""

from __future__ import annotations

from pathlib import Path

import json

import torch
import transformers as tf

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _llama():
    # llama3 rope scaling with a short original context so the smoothing is exercised
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return tf.LlamaConfig(**COMMON, num_hidden_layers=4, rope_parameters=rope), tf.LlamaForCausalLM


def _llama4_dense():
    # 6 layers: 0,1,2,4,5 chunked RoPE, 3 NoPE global; chunk 20 (not a multiple of block 8)
    cfg = tf.Llama4TextConfig(
        **COMMON,
        num_hidden_layers=6,
        head_dim=16,
        intermediate_size_mlp=80,
        attention_chunk_size=20,
        moe_layers=[],
        floor_scale=8,
        attn_scale=0.5,
    )
    return cfg, tf.Llama4ForCausalLM


def _llama4_moe():
    cfg = tf.Llama4TextConfig(
        **COMMON,
        num_hidden_layers=4,
        head_dim=16,
        intermediate_size_mlp=80,
        attention_chunk_size=16,
        moe_layers=[1, 3],
        num_local_experts=4,
        num_experts_per_tok=1,
        floor_scale=8,
        attn_scale=0.5,
    )
    return cfg, tf.Llama4ForCausalLM


def _gemma3():
    cfg = tf.Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=6,
        head_dim=16,
        sliding_window=12,
        sliding_window_pattern=3,  # s s f s s f
        query_pre_attn_scalar=24,
        final_logit_softcapping=5.0,
        # HF 5.24 Gemma3 ignores this (never passed to the attention); a biting value
        # makes the test fail if we ever apply it where HF does not
        attn_logit_softcapping=2.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    return cfg, tf.Gemma3ForCausalLM


def _mistral():
    return tf.MistralConfig(**COMMON, num_hidden_layers=4, sliding_window=10), tf.MistralForCausalLM


def _qwen2():
    cfg = tf.Qwen2Config(**COMMON, num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    return cfg, tf.Qwen2ForCausalLM


def _qwen3():
    # sliding upper layers and q/k biases (attention_bias puts one on o_proj too)
    cfg = tf.Qwen3Config(
        **COMMON, num_hidden_layers=4, head_dim=16, use_sliding_window=True, sliding_window=14, max_window_layers=1,
        attention_bias=True,
    )
    return cfg, tf.Qwen3ForCausalLM


def _qwen3_plain():
    # no biases: the quantized fused decode step describes its layers (q/k norms, sliding layers)
    cfg = tf.Qwen3Config(
        **COMMON, num_hidden_layers=4, head_dim=16, use_sliding_window=True, sliding_window=14, max_window_layers=1,
    )
    return cfg, tf.Qwen3ForCausalLM


def _gemma3_mm():
    # gemma-3-4b-it's text_config shape: heads 8, KV heads 4, head_dim 256 and query_pre_attn_scalar
    # 256 are transformers' defaults (written here only for the model we save; the file loses them)
    text = tf.Gemma3TextConfig(
        **{**COMMON, "num_attention_heads": 8, "num_key_value_heads": 4},
        num_hidden_layers=6,  # default pattern 6: s s s s s f
        sliding_window=12,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    vision = tf.SiglipVisionConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    cfg = tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=127, boi_token_index=125, eoi_token_index=126,
    )
    return cfg, tf.Gemma3ForConditionalGeneration


#: the keys google/gemma-3-4b-it's text_config holds (the rest is transformers' defaults), plus
#: vocab_size: the tiny model has 128 ids, not the default 262208
GEMMA3_4B_TEXT_KEYS = ("hidden_size", "intermediate_size", "model_type", "num_hidden_layers", "rope_scaling",
                       "sliding_window", "vocab_size")


def _llama4_mm():
    text = tf.Llama4TextConfig(
        **COMMON, num_hidden_layers=4, head_dim=16, intermediate_size_mlp=80, attention_chunk_size=20,
        moe_layers=[1], num_local_experts=2, floor_scale=8, attn_scale=0.5,
    )
    vision = tf.Llama4VisionConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16,
    )
    cfg = tf.Llama4Config(text_config=text, vision_config=vision, image_token_index=127, boi_token_index=125,
                          eoi_token_index=126)
    return cfg, tf.Llama4ForConditionalGeneration


def _gpt_oss():
    cfg = tf.GptOssConfig(
        **COMMON, num_hidden_layers=4, head_dim=16, sliding_window=12, num_local_experts=4, num_experts_per_tok=2
    )
    return cfg, tf.GptOssForCausalLM


CONFIGS = {
    "llama": _llama,
    "llama4_dense": _llama4_dense,
    "llama4_moe": _llama4_moe,
    "gemma3": _gemma3,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "gpt_oss": _gpt_oss,
}

#: models that differ from a CONFIGS one in their layers' maths or their checkpoint, not in what
#: the scheduler and KV cache do with them: test_parity checks them against HF (and through
#: LLMEngine) without re-running every engine scenario of test_engine / test_parity on them
EXTRA_CONFIGS = {
    "qwen3": _qwen3,
    "qwen3_plain": _qwen3_plain,
    "gemma3_mm": _gemma3_mm,
    "llama4_mm": _llama4_mm,
}


def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    gemma = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:
                if "norm" in name:
                    p.copy_((0.0 if gemma else 1.0) + 0.3 * noise)
                elif name.endswith("sinks"):
                    p.copy_(1.0 * noise)
                else:  # biases
                    p.copy_(0.3 * noise)
            else:
                fan_in = p.shape[-1] if p.ndim == 2 else p.shape[-2]
                p.copy_(noise * (1.5 / fan_in**0.5))


def build_tiny(name: str, path: Path, seed: int = 0):
    """Make, perturb and save model ``name`` under ``path``; return the HF model (eager, eval)."""
    config, cls = {**CONFIGS, **EXTRA_CONFIGS}[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    _redraw(model, seed)
    # no EOS in the saved model either: HF and the engine run every token, so each is compared
    # (tests of EOS handling give a model one, see test_engine.py)
    model.config.eos_token_id = None
    model.config.get_text_config().eos_token_id = None  # multimodal: text_config has its own
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    if name == "gemma3_mm":
        return _as_gemma3_4b_config(path, cls)
    if name == "llama4_mm":
        # HF 5.24's Llama4ForConditionalGeneration.forward fails without images (AttributeError:
        # 'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'); the reference is its
        # own language model, the Llama4ForCausalLM holding the weights the checkpoint was saved from
        text = model.language_model
        text.config._attn_implementation = "eager"
        text.generation_config.eos_token_id = None
        text.generation_config.pad_token_id = 0
        return text
    return model


def _as_gemma3_4b_config(path: Path, cls):
    """Cut the saved text_config down to gemma-3-4b-it's keys; transformers reloads it from the file."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    text = config["text_config"]
    text["rope_scaling"] = text.pop("rope_parameters")["full_attention"]  # the old format, full layers only
    del text["rope_scaling"]["rope_theta"]
    config["text_config"] = {k: text[k] for k in GEMMA3_4B_TEXT_KEYS}
    config.pop("tie_word_embeddings")
    config_file.write_text(json.dumps(config, indent=2))
    model = cls.from_pretrained(path, attn_implementation="eager").eval()
    assert (model.config.text_config.head_dim, model.config.text_config.num_attention_heads) == (256, 8)
    return model


def hf_generate(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy generation of one prompt: (new tokens, per-step logits [N, vocab])."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits, dim=0)
