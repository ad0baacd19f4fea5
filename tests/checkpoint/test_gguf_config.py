"""GGUF metadata -> HF config: transformers' own reading of the same files, Gemma 3's layout,
EOS ids, tied heads, and the typed errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from tests.support.gguf_tiny import write_gguf

from hybridkv.checkpoint import SUPPORTED_GGUF_ARCHITECTURES, GGUFFile, hf_config_from_gguf, read_model_config
from hybridkv.errors import GGUFFormatError, UnknownArchitectureError
from hybridkv.planner import model_layers

V = gguf.GGUFValueType


def _md(arch: str, layers: int = 6, **extra):
    md = {
        "general.architecture": arch,
        f"{arch}.block_count": layers,
        f"{arch}.embedding_length": 256,
        f"{arch}.feed_forward_length": 512,
        f"{arch}.context_length": 4096,
        f"{arch}.attention.head_count": 2,
        f"{arch}.attention.head_count_kv": 1,
        f"{arch}.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),
        f"{arch}.rope.freq_base": 50000.0,
        "tokenizer.ggml.tokens": ["a", "b", "c", "d"],
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.bos_token_id": 2,
    }
    md.update(extra)
    return md


def _typed(md: dict):
    out = []
    for k, v in md.items():
        if k == "general.architecture":
            continue
        if isinstance(v, list):
            out.append((k, v, V.ARRAY, V.STRING))
        elif isinstance(v, float):
            out.append((k, v, V.FLOAT32, None))
        elif isinstance(v, str):
            out.append((k, v, V.STRING, None))
        else:
            out.append((k, v, V.UINT32, None))
    return out


CASES = {
    "llama": _md("llama", **{"llama.rope.dimension_count": 128, "llama.vocab_size": 4}),
    "gemma3": _md("gemma3", layers=13, **{"gemma3.attention.key_length": 128, "gemma3.attention.value_length": 128,
                                          "gemma3.attention.sliding_window": 64}),
    "qwen2": _md("qwen2"),
    "qwen3": _md("qwen3", **{"qwen3.attention.key_length": 128}),
}


@pytest.mark.parametrize("arch", list(CASES))
@pytest.mark.parametrize("tied", [True, False])
def test_config_matches_transformers_reading_of_the_same_file(tmp_path, arch, tied):
    from transformers import AutoConfig

    md = CASES[arch]
    tensors = [] if tied else [("output.weight", np.zeros((4, 256), np.float32), None)]
    path = write_gguf(tmp_path / "m.gguf", arch, _typed(md), tensors)
    ours = read_model_config(path)
    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf").to_dict()
    assert ours["tie_word_embeddings"] is tied
    for key, value in ours.items():
        if key == "architectures":  # transformers leaves it null; we name the class
            assert theirs[key] is None and value[0].lower().startswith(arch[:4])
            continue
        assert theirs[key] == value, key
    model_layers(ours)  # the planner reads it


@pytest.mark.parametrize("layers", [1, 5, 6, 7, 12, 13, 18])
def test_gemma3_every_sixth_layer_is_full(layers):
    cfg = hf_config_from_gguf(_md("gemma3", layers=layers, **{"gemma3.attention.sliding_window": 512}))
    want = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    assert cfg["layer_types"] == want
    assert cfg["rope_parameters"] == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
    }
    assert (cfg["query_pre_attn_scalar"], cfg["final_logit_softcapping"], cfg["model_type"]) == (256, None, "gemma3_text")
    kinds = [k.kind for k in model_layers(cfg).kinds]
    assert kinds == ["full" if t == "full_attention" else "sliding" for t in want]


def test_rope_scaling_in_the_file_is_kept_on_global_layers():
    md = _md("gemma3", **{"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0})
    rope = hf_config_from_gguf(md)["rope_parameters"]
    assert rope["full_attention"] == {"rope_type": "linear", "rope_theta": 50000.0, "factor": 8.0}
    assert rope["sliding_attention"]["rope_type"] == "default"


def test_eos_and_eot_ids():
    assert hf_config_from_gguf(_md("llama"))["eos_token_id"] == 1
    assert hf_config_from_gguf(_md("llama", **{"tokenizer.ggml.eot_token_id": 106}))["eos_token_id"] == [1, 106]
    assert hf_config_from_gguf(_md("llama", **{"tokenizer.ggml.eot_token_id": 1}))["eos_token_id"] == 1
    with pytest.raises(GGUFFormatError, match="eos_token_id' must be an integer"):
        hf_config_from_gguf(_md("llama", **{"tokenizer.ggml.eos_token_id": "1"}))


def test_vocab_size_from_the_tokenizer_when_absent():
    assert hf_config_from_gguf(_md("qwen2"))["vocab_size"] == 4
    assert hf_config_from_gguf(_md("llama", **{"llama.vocab_size": 9}))["vocab_size"] == 9


@pytest.mark.parametrize("arch", ["falcon", "gpt2", "", "LLAMA"])
def test_unknown_architecture_names_the_supported_ones(arch):
    with pytest.raises(UnknownArchitectureError) as info:
        hf_config_from_gguf({"general.architecture": arch})
    assert repr(arch) in str(info.value)
    assert all(a in str(info.value) for a in SUPPORTED_GGUF_ARCHITECTURES)


def test_missing_required_keys():
    with pytest.raises(GGUFFormatError, match="no general.architecture"):
        hf_config_from_gguf({})
    md = _md("llama")
    del md["llama.block_count"]
    with pytest.raises(GGUFFormatError, match="llama.block_count must be a positive integer, got None"):
        hf_config_from_gguf(md)
    with pytest.raises(GGUFFormatError, match="embedding_length must be a positive integer"):
        hf_config_from_gguf(_md("llama", **{"llama.embedding_length": 0}))


def test_unknown_architecture_file_through_read_model_config(tmp_path):
    path = write_gguf(tmp_path / "f.gguf", "falcon", [("falcon.block_count", 2, V.UINT32, None)])
    assert GGUFFile.open(path).architecture == "falcon"
    with pytest.raises(UnknownArchitectureError, match="'falcon'; supported: gemma3, llama, qwen2, qwen3"):
        read_model_config(path)
