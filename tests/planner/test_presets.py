import json

import pytest

from hybridkv.errors import InvalidConfigError
from hybridkv.planner.presets import PRESETS, find_preset, load_model_config, preset_names


def test_the_presets():
    assert preset_names() == ["llama4-scout", "gemma-3-27b", "mistral-7b", "gpt-oss-20b", "llama-3.1-8b",
                              "qwen3-next-80b-a3b", "qwen3.5-35b-a3b"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_loads_as_a_json_object(name):
    src = load_model_config(name)
    assert src.preset is PRESETS[name]
    assert src.label == f"preset {name}"
    assert isinstance(src.config["architectures"], list)


def test_preset_values_are_the_published_ones():
    scout = load_model_config("llama4-scout").config
    assert scout["architectures"] == ["Llama4ForConditionalGeneration"]
    text = scout["text_config"]
    assert (text["num_hidden_layers"], text["num_key_value_heads"], text["head_dim"]) == (48, 8, 128)
    assert (text["attention_chunk_size"], text["no_rope_layers"]) == (8192, [])
    gemma = load_model_config("gemma-3-27b").config["text_config"]
    assert (gemma["num_hidden_layers"], gemma["num_key_value_heads"], gemma["head_dim"], gemma["sliding_window"]) == (
        62, 16, 128, 1024)
    mistral = load_model_config("mistral-7b").config
    assert (mistral["num_hidden_layers"], mistral["sliding_window"], mistral["hidden_size"]) == (32, 4096, 4096)
    oss = load_model_config("gpt-oss-20b").config
    assert oss["layer_types"][:2] == ["sliding_attention", "full_attention"] and len(oss["layer_types"]) == 24
    assert (oss["sliding_window"], oss["head_dim"]) == (128, 64)
    nxt = load_model_config("qwen3-next-80b-a3b").config
    assert nxt["architectures"] == ["Qwen3NextForCausalLM"] and "layer_types" not in nxt
    assert (nxt["num_hidden_layers"], nxt["full_attention_interval"], nxt["num_key_value_heads"], nxt["head_dim"]) == (
        48, 4, 2, 256)
    assert [nxt[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim",
                                         "conv_kernel_dim")] == [16, 32, 128, 128, 4]
    q35 = load_model_config("qwen3.5-35b-a3b").config
    assert q35["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    text = q35["text_config"]
    assert (text["num_hidden_layers"], text["num_key_value_heads"], text["mamba_ssm_dtype"]) == (40, 2, "float32")
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 10


@pytest.mark.parametrize(
    "name, preset",
    [("LLAMA4-SCOUT", "llama4-scout"), ("meta-llama/Llama-4-Scout-17B-16E", "llama4-scout"),
     ("gemma-3-27b-it", "gemma-3-27b"), ("mistralai/Mistral-7B-v0.1", "mistral-7b"), ("nope", None),
     ("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3-next-80b-a3b"), ("qwen3-next", "qwen3-next-80b-a3b"),
     ("Qwen/Qwen3.5-35B-A3B", "qwen3.5-35b-a3b")],
)
def test_find_preset(name, preset):
    found = find_preset(name)
    assert (found.name if found else None) == preset


def test_load_a_file_and_a_directory(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    by_file = load_model_config(str(tmp_path / "config.json"))
    by_dir = load_model_config(tmp_path)
    assert by_file.config == by_dir.config == cfg
    assert by_file.label == str(tmp_path / "config.json") and by_file.preset is None


def test_missing_path_lists_presets(tmp_path):
    with pytest.raises(InvalidConfigError, match=r"neither a config.json file nor a preset; presets: llama4-scout, "):
        load_model_config(str(tmp_path / "absent.json"))


def test_bad_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "architectures": [\n')
    with pytest.raises(InvalidConfigError, match=rf"{path}: not valid JSON \(line 3 column 1"):
        load_model_config(str(path))


def test_json_must_be_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(InvalidConfigError, match="must hold a JSON object, got list"):
        load_model_config(str(path))


def test_directory_without_config(tmp_path):
    with pytest.raises(InvalidConfigError, match="neither a config.json"):
        load_model_config(tmp_path)
