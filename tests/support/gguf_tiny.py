"""Synthetic GGUF files for the loader tests, written with the gguf package's GGUFWriter.

:func:`write_like_llama_cpp` converts a tiny random HF model (``tests/support/hf_tiny.py``)
the way llama.cpp's ``convert_hf_to_gguf.py`` does: names through
``gguf.get_tensor_name_map`` (the package's own table, not ours), Llama's q/k rows
permuted (``LlamaModel.permute``), Gemma's norm weights stored ``+ 1``, a tied head
left out, and the 2-D weights quantized with ``gguf.quants.quantize`` in turn through
every type the package can quantize at these sizes (1-D tensors F32, as llama.cpp).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import gguf
import numpy as np

#: the types gguf.quants can quantize for rows of 32 values (TQ1_0 / TQ2_0 need rows of 256)
QUANT_CYCLE = (
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q5_0,
    gguf.GGMLQuantizationType.Q5_1,
    gguf.GGMLQuantizationType.MXFP4,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.F32,
)


def write_gguf(
    path: Path,
    arch: str,
    metadata: Iterable[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = (),
    tensors: Iterable[tuple[str, np.ndarray, gguf.GGMLQuantizationType | None]] = (),
) -> Path:
    """A GGUF file at ``path``: ``metadata`` (key, value, type, array item type), ``tensors``
    (name, array, raw type: None for a float32 / float16 array stored as is)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value, vtype, sub in metadata:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, array, raw in tensors:
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (HF rows [h, 2, d/2] -> [h, d/2, 2])."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(arch: str, cfg) -> list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    V = gguf.GGUFValueType
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    theta = (rope.get("full_attention") or rope).get("rope_theta", 10000.0)
    md = [
        (f"{arch}.context_length", cfg.max_position_embeddings, V.UINT32, None),
        (f"{arch}.embedding_length", cfg.hidden_size, V.UINT32, None),
        (f"{arch}.block_count", cfg.num_hidden_layers, V.UINT32, None),
        (f"{arch}.feed_forward_length", cfg.intermediate_size, V.UINT32, None),
        (f"{arch}.attention.head_count", cfg.num_attention_heads, V.UINT32, None),
        (f"{arch}.attention.head_count_kv", cfg.num_key_value_heads, V.UINT32, None),
        (f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps, V.FLOAT32, None),
        (f"{arch}.rope.freq_base", float(theta), V.FLOAT32, None),
        ("tokenizer.ggml.model", "gpt2", V.STRING, None),
        ("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)], V.ARRAY, V.STRING),
        ("tokenizer.ggml.token_type", [1] * cfg.vocab_size, V.ARRAY, V.INT32),
        ("tokenizer.ggml.bos_token_id", 1, V.UINT32, None),
    ]
    if arch == "gemma3":
        md += [
            (f"{arch}.attention.key_length", head_dim, V.UINT32, None),
            (f"{arch}.attention.value_length", head_dim, V.UINT32, None),
            (f"{arch}.attention.sliding_window", cfg.sliding_window, V.UINT32, None),
        ]
    else:
        md += [
            (f"{arch}.rope.dimension_count", head_dim, V.UINT32, None),
            (f"{arch}.vocab_size", cfg.vocab_size, V.UINT32, None),
        ]
    return md


def write_like_llama_cpp(hf_model, arch: str, path: Path, quant_cycle=QUANT_CYCLE, start: int = 0) -> Path:
    """``hf_model`` (a tiny HF ``LlamaForCausalLM`` / ``Gemma3ForCausalLM``) as llama.cpp writes it."""
    cfg = hf_model.config
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    tensors = []
    i = start
    for hf_name, t in hf_model.state_dict().items():
        if cfg.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        w = t.detach().float().numpy().copy()
        if arch == "llama" and ".attn_q." in gguf_name:
            w = _permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            w = _permute(w, cfg.num_key_value_heads)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            w = w + 1
        if w.ndim == 1:
            tensors.append((gguf_name, w.astype(np.float32), None))
            continue
        qtype = quant_cycle[i % len(quant_cycle)]
        i += 1
        if qtype == gguf.GGMLQuantizationType.F32:
            tensors.append((gguf_name, w.astype(np.float32), None))
        elif qtype == gguf.GGMLQuantizationType.F16:
            tensors.append((gguf_name, w.astype(np.float16), None))
        else:
            tensors.append((gguf_name, gguf.quants.quantize(w, qtype), qtype))
    return write_gguf(path, arch, _metadata(arch, cfg), tensors)
