import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from _hf_tiny import build_tiny, hf_generate  # noqa: E402

from hybridkv.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4")
    hf = build_tiny("llama4_dense", path)
    return path, hf


def test_generate_prompt_ids_matches_hf(model_dir, capsys):
    path, hf = model_dir
    prompt = list(range(3, 43))
    assert main(["generate", str(path), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "6",
                 "--block-size", "8"]) == 0
    out = capsys.readouterr().out.strip()
    assert [int(t) for t in out.split(",")] == hf_generate(hf, prompt, 6)[0]


def test_generate_json_two_prompts(model_dir, capsys):
    path, _ = model_dir
    assert main(["generate", str(path), "--prompt-ids", "1,2,3", "--prompt-ids", "1 2 3 4", "--max-tokens", "3",
                 "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [len(x["output_ids"]) for x in lines] == [3, 3] and lines[1]["prompt_ids"] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-ids", "1,x"], "comma-separated ints"),
        (["--prompt-ids", "1,999"], "token ids must be ints in [0, 128)"),
        ([], "at least one"),
        (["--prompt", "hi"], "vocabulary of >= 256"),
        (["--prompt-ids", ",".join(["1"] * 600)], "exceeds max_model_len"),
        (["--prompt-ids", "1,2", "--stop-token-ids", "7,y"], "--stop-token-ids takes comma-separated ints"),
        (["--prompt-ids", "1,2", "--stop-token-ids", "-3"], "token ids must be non-negative"),
    ],
)
def test_bad_input_one_line_exit_2(model_dir, capsys, argv, message):
    path, _ = model_dir
    assert main(["generate", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_model_dir_is_a_clean_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "generate", str(tmp_path / "nope"), "--prompt-ids", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_byte_level_text_mode(tmp_path, capsys):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, num_hidden_layers=2, max_position_embeddings=128)
    hf = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than HF's init: logits far from ties
        for param in hf.parameters():
            param.normal_(0, 0.3)
    hf.generation_config.eos_token_id = None  # config.json keeps LlamaConfig's EOS 2: both run 5 tokens
    hf.save_pretrained(tmp_path)
    prompt = list("héllo".encode("utf-8"))
    want = hf_generate(hf, prompt, 5)[0]
    assert main(["generate", str(tmp_path), "--prompt", "héllo", "--max-tokens", "5", "--json", "--ignore-eos"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompt_ids"] == prompt and record["output_ids"] == want
    assert record["text"] == bytes(t for t in want if t < 256).decode("utf-8", errors="replace")


def _first_new(tokens: list[int]) -> int:
    """Index of the first token (from the second on) that has not appeared before it."""
    return next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids_end_a_request_early(model_dir, capsys):
    path, hf = model_dir
    prompt = list(range(3, 43))
    want = hf_generate(hf, prompt, 6)[0]
    i = _first_new(want)
    assert i + 1 < len(want)  # the stop comes before max_tokens
    ids = ",".join(map(str, prompt))
    assert main(["generate", str(path), "--prompt-ids", ids, "--max-tokens", "6",
                 "--stop-token-ids", f"{want[i]},1000", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["output_ids"] == want[: i + 1] and first["finish_reason"] == "stop"


def test_model_eos_ends_a_request_unless_ignored(model_dir, tmp_path, capsys):
    src, hf = model_dir
    prompt = list(range(3, 43))
    want = hf_generate(hf, prompt, 6)[0]
    i = _first_new(want)
    path = tmp_path / "with-eos"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": want[i]}))
    argv = ["generate", str(path), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "6"]
    assert main(argv) == 0
    assert [int(t) for t in capsys.readouterr().out.strip().split(",")] == want[: i + 1]
    assert main([*argv, "--ignore-eos"]) == 0
    assert [int(t) for t in capsys.readouterr().out.strip().split(",")] == want
