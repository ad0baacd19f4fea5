import json
import subprocess
import sys

import pytest

from hybridkv.cli import main


def run(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_llama4_scout_readme_job(capsys):
    rc, out, err = run(capsys, "llama4-scout", "--memory", "80GiB", "--max-model-len", "1M")
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "model       meta-llama/Llama-4-Scout-17B-16E (Llama4ForConditionalGeneration)"
    rows = {line.split("  ")[0]: line.split() for line in lines if line.startswith(("hybrid ", "full only"))}
    # hybrid: 80 GiB // (12 * 65536) = 109_226 blocks; full: 80 GiB // (48 * 65536) = 27_306
    assert rows["hybrid"][1:] == ["4", "12", "768", "KiB", "109,226", "67,456", "1.62x", "1,716,880"]
    assert rows["full only"][2:] == ["1", "48", "3", "MiB", "27,306", "65,536", "0.42x", "436,880"]
    assert rows["hybrid / full"][-2:] == ["3.89x", "3.93x"]


def test_json_output(capsys):
    rc, out, _ = run(capsys, "gemma-3-27b", "--memory", "80GiB", "--max-model-len", "1M", "--json")
    assert rc == 0
    d = json.loads(out)
    # group size 10 -> 10 * 131072 bytes per block -> 80 GiB / 1_310_720 = 65_536 blocks
    assert (d["hybrid"]["group_size"], d["hybrid"]["num_groups"], d["hybrid"]["num_blocks"]) == (10, 7, 65_536)
    assert d["hybrid"]["padding_bytes_per_request"] == 8 * 193 * 131072  # 1023 + 2048 tokens: 193 blocks
    assert d["full"]["num_blocks"] == 85_899_345_920 // (62 * 131072) == 10_570


def test_no_hybrid_block_size_and_dtype(capsys):
    rc, out, _ = run(capsys, "llama4-scout", "--max-model-len", "128k", "--no-hybrid", "--block-size", "32",
                     "--dtype", "fp8", "--json")
    d = json.loads(out)
    assert rc == 0 and d["layout_in_use"] == "full" and d["hybrid_enabled"] is False
    assert d["max_model_len"] == 128_000 and d["model"]["block_size"] == 32 and d["model"]["dtype"] == "fp8"
    # page = 2 * 32 * 8 * 128 * 1 = 65536 -> full: 80 GiB // (48 * 65536) = 27_306 blocks, cdiv(128000, 32) per request
    assert d["full"]["num_blocks"] == 27_306 and d["full"]["blocks_per_request"] == 4000


def test_config_file_path(capsys, tmp_path):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "hidden_size": 512, "use_sliding_window": True, "sliding_window": 64,
           "max_window_layers": 2, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = run(capsys, str(tmp_path), "--memory", "64MiB", "--json")
    d = json.loads(out)
    assert rc == 0 and d["max_model_len"] == 4096
    # page 2 * 16 * 2 * 128 * 2 = 16384; layers 0,1 full, 2,3 sliding: group size 2 -> 32768 per block
    assert (d["hybrid"]["group_size"], d["hybrid"]["num_blocks"]) == (2, 64 * 2**20 // 32768)
    assert d["hybrid"]["blocks_per_request"] == 4096 // 16 + (63 + 2048 - 1) // 16 + 2  # window + 2048 new
    rc, out, _ = run(capsys, str(tmp_path), "--memory", "64MiB", "--json", "--max-num-batched-tokens", "1")
    assert json.loads(out)["hybrid"]["blocks_per_request"] == 4096 // 16 + 5  # 63 + 1 tokens: <= 5 blocks


@pytest.mark.parametrize(
    "argv, message",
    [
        (["llama4-scout", "--memory", "80XB"], "unknown memory unit 'XB' in '80XB'"),
        (["llama4-scout", "--memory=-1GiB"], "invalid memory size '-1GiB'"),
        (["llama4-scout", "--memory", "1MiB"], "1 MiB holds 1 block(s) of 768 KiB"),
        (["llama4-scout", "--max-model-len", "1.5M"], "decimals are not allowed with the binary suffix 'M'"),
        (["llama4-scout", "--max-model-len", "lots"], "invalid token count 'lots'"),
        (["llama4-scout", "--block-size", "0"], "argument --block-size: expected an integer >= 1, got '0'"),
        (["llama4-scout", "--dtype", "int4"], "KV cache dtype 'int4' is not supported"),
        (["no-such-model"], "'no-such-model' is neither a config.json file nor a preset; presets: llama4-scout"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("hybridkv plan: error: ") and err.endswith("\n") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"architectures": ["FalconForCausalLM"]}', "unsupported architecture ('FalconForCausalLM'); supported: "),
        ('{"architectures": ["LlamaForCausalLM"]}', "config.json: num_hidden_layers is missing"),
        ('{"architectures": ["LlamaForCausalLM"', "config.json: not valid JSON (line 1"),
        ('{"architectures": ["MistralForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 2, '
         '"hidden_size": 8, "layer_types": ["full_attention"]}', "layer_types has 1 entries but the model has 2 layers"),
    ],
)
def test_bad_config_is_one_line_exit_2(capsys, tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    rc, out, err = run(capsys, str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"hybridkv plan: error: {path}") and message in err


def test_argparse_errors_are_one_line(capsys):
    assert main(["plan", "llama4-scout", "--block-size", "x"]) == 2
    err = capsys.readouterr().err
    assert err == "hybridkv plan: error: argument --block-size: expected an integer >= 1, got 'x'\n"


def test_python_m_hybridkv_plan_llama4_scout():
    result = subprocess.run([sys.executable, "-m", "hybridkv", "plan", "llama4-scout"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # defaults: 80 GiB, max model len = max_position_embeddings = 10_485_760 (10M) tokens
    assert "budget      80 GiB (85,899,345,920 bytes), max model len 10,485,760 tokens" in result.stdout
    hybrid = next(line for line in result.stdout.splitlines() if line.startswith("hybrid  "))
    # 10M / 16 = 655_360 full blocks + 3 * 640 chunked = 657_280 blocks per request
    assert hybrid.split()[6] == "657,280"
