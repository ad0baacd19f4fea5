import pytest

from hybridkv.core.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, UnknownArchitectureError
from hybridkv.planner.architectures import find_family, language_model_config, model_layers, supported_architectures
from hybridkv.planner.presets import load_model_config


def preset(name, **kw):
    src = load_model_config(name)
    return model_layers(src.config, label=src.label, **kw)


def kinds(model):
    """Per layer: 'F' full, 'S<window>' sliding, 'C<chunk>' chunked."""
    out = []
    for s in model.specs:
        if isinstance(s, SlidingWindowSpec):
            out.append(f"S{s.sliding_window}")
        elif isinstance(s, ChunkedLocalAttentionSpec):
            out.append(f"C{s.attention_chunk_size}")
        else:
            assert type(s) is FullAttentionSpec
            out.append("F")
    return out


def full_layers(model):
    return [i for i, k in enumerate(kinds(model)) if k == "F"]


def test_llama4_scout_rope_layers_are_chunked_nope_layers_full():
    m = preset("llama4-scout")
    # no_rope_layers is [] in the published config -> transformers' default: every 4th layer is NoPE
    assert full_layers(m) == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]
    assert kinds(m).count("C8192") == 36
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.dtype, m.block_size) == (48, 8, 128, "bfloat16", 16)
    assert m.architecture == "Llama4ForConditionalGeneration" and m.family == "llama4"
    assert m.max_position_embeddings == 10_485_760
    # 2 (K, V) * 16 tokens * 8 heads * 128 dims * 2 bytes
    assert {s.page_size_bytes for s in m.specs} == {2 * 16 * 8 * 128 * 2} == {65536}


def llama4(**text):
    base = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    return {"architectures": ["Llama4ForConditionalGeneration"], "text_config": {**base, **text}}


def test_llama4_explicit_no_rope_layers():
    # 1 = uses RoPE = chunked; 0 = NoPE = full
    m = model_layers(llama4(no_rope_layers=[0, 1, 1, 0], attention_chunk_size=64))
    assert kinds(m) == ["F", "C64", "C64", "F"]


def test_llama4_interval_and_layer_types():
    assert kinds(model_layers(llama4(no_rope_layer_interval=2))) == ["C8192", "F", "C8192", "F"]
    m = model_layers(llama4(layer_types=["full_attention", "chunked_attention"] * 2, no_rope_layers=[1, 1, 1, 1]))
    assert kinds(m) == ["F", "C8192", "F", "C8192"]


def test_llama4_without_chunk_size_is_all_full():
    assert kinds(model_layers(llama4(attention_chunk_size=None))) == ["F"] * 4


def test_llama4_no_rope_layers_of_wrong_length():
    with pytest.raises(InvalidConfigError, match=r"config: text_config.no_rope_layers has 3 entries but the model has 4"):
        model_layers(llama4(no_rope_layers=[1, 1, 0]))


def test_gemma3_27b_every_sixth_layer_full():
    m = preset("gemma-3-27b")
    assert full_layers(m) == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert kinds(m).count("S1024") == 52
    assert (m.num_layers, m.num_kv_heads, m.head_dim) == (62, 16, 128)
    assert m.max_position_embeddings == 131_072  # absent from the config: Gemma3TextConfig's default
    assert m.specs[0].page_size_bytes == 2 * 16 * 16 * 128 * 2 == 131072


def gemma3_text(**kw):
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 1, **kw}


def test_gemma3_text_only_pattern_and_defaults():
    m = model_layers(gemma3_text(sliding_window_pattern=2, sliding_window=512))
    assert kinds(m) == ["S512", "F", "S512", "F"]
    assert m.head_dim == 256  # Gemma3TextConfig's head_dim default, not hidden_size // heads
    assert kinds(model_layers(gemma3_text())) == ["S4096"] * 4  # pattern 6, window 4096 by default


def test_gemma3_layer_types_win():
    m = model_layers(gemma3_text(layer_types=["full_attention", "sliding_attention", "full_attention",
                                              "sliding_attention"], sliding_window_pattern=2, sliding_window=8))
    assert kinds(m) == ["F", "S8", "F", "S8"]


def test_bad_layer_type_names_the_index():
    with pytest.raises(InvalidConfigError, match=r"layer_types\[1\] is 'local'"):
        model_layers(gemma3_text(layer_types=["full_attention", "local", "full_attention", "full_attention"]))


def test_mistral_7b_all_sliding():
    m = preset("mistral-7b")
    assert kinds(m) == ["S4096"] * 32
    assert (m.num_kv_heads, m.head_dim) == (8, 4096 // 32)


def mistral(**kw):
    return {"architectures": ["MistralForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 2,
            "hidden_size": 64, **kw}


def test_mistral_null_window_is_full_and_layer_types_are_checked_not_used():
    assert kinds(model_layers(mistral(sliding_window=None))) == ["F", "F"]
    # transformers' MistralModel builds one mask for every layer (and warns to use Ministral)
    assert kinds(model_layers(mistral(sliding_window=16, layer_types=["sliding_attention", "full_attention"]))) == [
        "S16", "S16"]
    with pytest.raises(InvalidConfigError, match=r"layer_types\[1\] is 'local'"):
        model_layers(mistral(layer_types=["full_attention", "local"]))
    m = model_layers(mistral())
    assert kinds(m) == ["S4096", "S4096"]  # MistralConfig's default window
    assert (m.head_dim, m.num_kv_heads) == (32, 8)


def qwen(arch="Qwen2ForCausalLM", **kw):
    return {"architectures": [arch], "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_size": 256, **kw}


def test_qwen_sliding_needs_use_sliding_window():
    assert kinds(model_layers(qwen(sliding_window=32, max_window_layers=2))) == ["F"] * 4
    m = model_layers(qwen(use_sliding_window=True, sliding_window=32, max_window_layers=2))
    assert kinds(m) == ["F", "F", "S32", "S32"]  # layers i >= max_window_layers slide
    assert m.head_dim == 256 // 4


def test_qwen_layer_types():
    types = ["sliding_attention", "full_attention"] * 2
    # window off: transformers sets sliding_window to None and then fails on the sliding layers
    with pytest.raises(InvalidConfigError, match=r"^config: layer 0 is sliding_attention \(layer_types\) but "
                       r"sliding_window is null \(use_sliding_window is false"):
        model_layers(qwen(layer_types=types, sliding_window=32))
    assert kinds(model_layers(qwen(layer_types=["attention", "full_attention"] * 2))) == ["F"] * 4  # legacy name
    assert kinds(model_layers(qwen(layer_types=types, sliding_window=32, use_sliding_window=True))) == [
        "S32", "F", "S32", "F"]


def test_qwen3_default_head_dim_and_bad_flag():
    assert model_layers(qwen("Qwen3ForCausalLM")).head_dim == 128
    with pytest.raises(InvalidConfigError, match=r"use_sliding_window must be true or false, got 'yes'"):
        model_layers(qwen(use_sliding_window="yes"))


def test_gpt_oss_20b_alternates():
    m = preset("gpt-oss-20b")
    assert kinds(m) == ["S128", "F"] * 12
    assert (m.num_kv_heads, m.head_dim, m.dtype) == (8, 64, "bfloat16")  # no torch_dtype: default bfloat16
    assert m.specs[0].page_size_bytes == 2 * 16 * 8 * 64 * 2 == 32768
    cfg = load_model_config("gpt-oss-20b").config
    del cfg["layer_types"]
    assert kinds(model_layers(cfg)) == ["S128", "F"] * 12  # GptOssConfig's derivation


def test_llama_3_1_8b_all_full():
    m = preset("llama-3.1-8b")
    assert kinds(m) == ["F"] * 32 and (m.num_kv_heads, m.head_dim) == (8, 128)


def test_null_heads_fall_back():
    m = model_layers({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "num_attention_heads": 8,
                      "num_key_value_heads": None, "head_dim": None, "hidden_size": 512})
    assert (m.num_kv_heads, m.head_dim) == (8, 64)


def test_dtype_from_config_and_override():
    cfg = qwen(torch_dtype="float32")
    assert model_layers(cfg).specs[0].page_size_bytes == 2 * 16 * 2 * 64 * 4
    assert model_layers(qwen(dtype="float16")).dtype == "float16"
    assert model_layers(cfg, dtype="fp8").specs[0].page_size_bytes == 2 * 16 * 2 * 64 * 1
    assert model_layers(cfg, block_size=32).specs[0].block_size == 32
    with pytest.raises(InvalidConfigError, match=r"config: torch_dtype 'int3' is not supported"):
        model_layers(qwen(torch_dtype="int3"))
    with pytest.raises(InvalidArgumentError, match=r"KV cache dtype 'int3' is not supported"):
        model_layers(cfg, dtype="int3")
    with pytest.raises(InvalidArgumentError, match=r"block size must be a positive integer, got 0"):
        model_layers(cfg, block_size=0)


def test_family_by_model_type_when_architectures_unknown():
    fam, by = find_family({"architectures": ["Qwen2ForSequenceClassification"], "model_type": "qwen2"})
    assert (fam.name, by) == ("qwen2", "qwen2")
    fam, by = find_family({"text_config": {"model_type": "llama4_text"}})
    assert (fam.name, by) == ("llama4", "llama4_text")


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(UnknownArchitectureError) as exc:
        model_layers({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}, label="x.json")
    msg = str(exc.value)
    assert msg.startswith("x.json: unsupported architecture ('FalconForCausalLM', model_type 'falcon'); supported: ")
    assert all(a in msg for a in supported_architectures())
    assert "Llama4ForConditionalGeneration" in msg and "GptOssForCausalLM" in msg


def test_missing_and_malformed_keys_name_key_and_file():
    with pytest.raises(InvalidConfigError, match=r"^cfg.json: text_config.num_hidden_layers is missing$"):
        model_layers({"architectures": ["Llama4ForConditionalGeneration"], "text_config": {}}, label="cfg.json")
    with pytest.raises(InvalidConfigError, match=r"^cfg.json: hidden_size is missing$"):
        model_layers({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2}, label="cfg.json")
    with pytest.raises(InvalidConfigError, match=r"num_hidden_layers must be a positive integer, got '32'"):
        model_layers(mistral(num_hidden_layers="32"))
    with pytest.raises(InvalidConfigError, match=r"text_config must be a JSON object"):
        model_layers({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": [1]})
    with pytest.raises(InvalidConfigError, match=r"hidden_size \(100\) is not a multiple of num_attention_heads \(3\)"):
        model_layers({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100})


def test_language_model_config_flattens_and_fills_transformers_defaults():
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
           "text_config": {"num_hidden_layers": 34, "hidden_size": 2560, "sliding_window": 1024}}
    text = language_model_config(cfg)
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (8, 4, 256)
    assert (text["sliding_window"], text["query_pre_attn_scalar"], text["vocab_size"]) == (1024, 256, 262_208)
    assert text["eos_token_id"] == [1, 106] and text["torch_dtype"] == "bfloat16"
    assert text["tie_word_embeddings"] is True  # Gemma3Config's (top-level) default
    assert language_model_config({**cfg, "tie_word_embeddings": False})["tie_word_embeddings"] is False
    scout = language_model_config(load_model_config("llama4-scout").config)
    assert scout["tie_word_embeddings"] is False and scout["attention_chunk_size"] == 8192
    # a flat config: its own keys win, null stays null; the input is not changed
    flat = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "sliding_window": None}
    out = language_model_config(flat)
    assert out["sliding_window"] is None and out["head_dim"] == 128 and "head_dim" not in flat
    assert model_layers(out, family="qwen3").kinds == model_layers(flat).kinds


def test_local_layer_without_size_is_refused_like_transformers():
    with pytest.raises(InvalidConfigError, match=r"^config: layer 0 is sliding_attention \(every layer but each 6th, "
                       r"by sliding_window_pattern\) but sliding_window is null; transformers cannot run"):
        model_layers(gemma3_text(sliding_window=None))
    assert kinds(model_layers(gemma3_text(sliding_window=None, sliding_window_pattern=1))) == ["F"] * 4
    with pytest.raises(InvalidConfigError, match=r"layer 0 is sliding_attention \(even layers"):
        model_layers(qwen("GptOssForCausalLM", sliding_window=None))
    with pytest.raises(InvalidConfigError, match=r"layer 1 is chunked_attention \(layer_types\) but "
                       r"text_config.attention_chunk_size is null"):
        model_layers(llama4(attention_chunk_size=None, layer_types=["full_attention", "chunked_attention"] * 2))
    with pytest.raises(InvalidConfigError, match=r"layer_types\[0\] is 'chunked_attention'; expected one of "
                       r"\['attention', 'full_attention', 'sliding_attention'\]"):
        model_layers(gemma3_text(layer_types=["chunked_attention"] * 4))
