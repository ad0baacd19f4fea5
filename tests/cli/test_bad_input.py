"""Every bad CLI input is one line on stderr and exit code 2; nothing hangs.

A table of cases (inputs that once raised a traceback, hung or gave an unclear message,
and more found by probing) runs in-process through :func:`hybridkv.cli.main` under an
alarm (a hang fails the test instead of stalling CI); a few run as ``python -m hybridkv``
to prove there is no traceback at all (stdout on a full disk, a closed pipe, the hangs).
Placeholders in argv: ``{M}`` a tiny saved Llama, ``{T}`` a folder of bad files made by
:func:`bad_files`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples, slow_except

from hybridkv.cli import main

HANG_SECONDS = 60


@contextlib.contextmanager
def hang_guard(seconds: int = HANG_SECONDS):
    """Fail (instead of hanging) if the body runs past ``seconds``."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def no_hang():
    with hang_guard():
        yield


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny_llama):
    """{T}: traces, configs and model folders, each wrong in one way."""
    t = tmp_path_factory.mktemp("bad")
    config = json.loads((tiny_llama / "config.json").read_text())
    (t / "binary.jsonl").write_bytes(b'{"prompt": [1], "output_len": 1}\n\x00\xff\xfe\x80binary\n')
    (t / "nested.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (t / "huge-prompt.jsonl").write_text('{"prompt_len": 100000000000, "output_len": 1}\n')
    (t / "late.jsonl").write_text('{"prompt": [1, 2], "output_len": 1, "arrival": 1000000000000}\n')
    (t / "empty.jsonl").write_text("")
    (t / "float.jsonl").write_text('{"prompt_len": 1e3, "output_len": 1}\n')
    (t / "trace-dir.jsonl").mkdir()
    os.mkfifo(t / "fifo.jsonl")
    (t / "surrogate.jsonl").write_text('{"id": "\\u2603\\ud800", "prompt": [1, 2], "output_len": 2}\n')
    (t / "nested.json").write_text("[" * 100_000 + "]" * 100_000)
    (t / "binary.json").write_bytes(b"\xff\xfe\x00")
    (t / "empty.json").write_text("")
    (t / "layers.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    (t / "layers-float.json").write_text(json.dumps({**config, "num_hidden_layers": 1e9}))
    (t / "no-config").mkdir()
    (t / "weights.bin").write_bytes(b"x")
    for name, make in {
        "dangling": lambda p: os.symlink(t / "gone" / "model.safetensors", p),
        "folder": lambda p: p.mkdir(),
        "empty": lambda p: p.write_bytes(b""),
        "garbage": lambda p: p.write_bytes(b"garbage!garbage!"),
        "truncated": lambda p: p.write_bytes((tiny_llama / "model.safetensors").read_bytes()[:4096]),
    }.items():
        folder = t / f"st-{name}"
        folder.mkdir()
        shutil.copy(tiny_llama / "config.json", folder)
        make(folder / "model.safetensors")
    deep = t / "deep-config"
    deep.mkdir()
    (deep / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    shutil.copy(tiny_llama / "model.safetensors", deep)  # only the config is wrong
    # ---- text: a model with a tokenizer, one whose chat template raises, prompts files
    from tests.support.tiny_tokenizer import write_tokenizer

    for name, template in (("with-tok", None), ("raising-template", "{{ raise_exception('no chats here') }}")):
        shutil.copytree(tiny_llama, t / name)
        write_tokenizer(t / name, **({"template": template} if template else {}))
    (t / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05\x00")
    (t / "not-gguf.gguf").write_bytes(b"PK\x03\x04 a zip file")
    (t / "empty-prompts.txt").write_text("\n  \n")
    (t / "bad-line.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    (t / "no-key.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    (t / "bad-messages.jsonl").write_text('{"messages": [{"role": "user"}]}\n')
    (t / "latin1.txt").write_bytes(b"caf\xe9\n")
    return t


CASES = [
    # ---- inputs that once raised a traceback
    ("binary trace", ["simulate", "mistral-7b", "--workload", "{T}/binary.jsonl"],
     "binary.jsonl:2: not UTF-8 text (byte 0xff at column 2)"),
    ("plot .txt", ["simulate", "mistral-7b", "--plot", "{T}/out.txt"], "cannot plot to {T}/out.txt: suffix .txt; use one of"),
    ("plot no folder", ["simulate", "mistral-7b", "--plot", "{T}/nope/out.png"], "folder {T}/nope does not exist"),
    ("temperature nan", ["generate", "{M}", "--prompt-ids", "1", "--temperature", "nan"],
     "argument --temperature: expected a finite number >= 0, got 'nan'"),
    ("temperature inf", ["generate", "{M}", "--prompt-ids", "1", "--temperature", "inf"], "finite number"),
    ("top-p nan", ["generate", "{M}", "--prompt-ids", "1", "--top-p", "nan"], "argument --top-p: expected a finite"),
    ("device gpu", ["generate", "{M}", "--prompt-ids", "1", "--device", "gpu"], "expected cpu, cuda or cuda:N, got 'gpu'"),
    ("device cpu:1", ["serve", "{M}", "--device", "cpu:1"], "expected cpu, cuda or cuda:N, got 'cpu:1'"),
    ("attention backend", ["generate", "{M}", "--prompt-ids", "1", "--attention-backend", "flash"],
     "argument --attention-backend: invalid choice: 'flash'"),
    ("quantization int3", ["generate", "{M}", "--prompt-ids", "1", "--quantization", "int3"],
     "argument --quantization: invalid choice: 'int3'"),
    ("quantization gguf of safetensors", ["generate", "{M}", "--prompt-ids", "1", "--quantization", "gguf"],
     "is not a GGUF checkpoint"),
    ("max-tokens past the context", ["generate", "{M}", "--prompt-ids", "1,2,3", "--max-model-len", "16",
                                     "--max-tokens", "14"],
     "maximum context length is 16 tokens; you requested 17 tokens (3 in the prompt, 14 for the completion)"),
    ("trace prompt_len 1e11", ["simulate", "mistral-7b", "--workload", "{T}/huge-prompt.jsonl"],
     "huge-prompt.jsonl:1: a prompt of 100,000,000,000 tokens exceeds max_model_len 131,072"),
    ("trace arrival 1e12", ["simulate", "mistral-7b", "--workload", "{T}/late.jsonl"], "past the last step simulated"),
    ("num_hidden_layers 10**9", ["plan", "{T}/layers.json"], "num_hidden_layers is 1,000,000,000; more than 10,000"),
    ("num_hidden_layers 1e9", ["plan", "{T}/layers-float.json"], "num_hidden_layers must be a positive integer"),
    ("generate 10**9 layers", ["generate", "{T}/layers.json", "--prompt-ids", "1"], "layers.json: not a GGUF file"),
    ("nested config", ["plan", "{T}/nested.json"], "nested.json: JSON nested too deeply"),
    ("nested config dir", ["generate", "{T}/deep-config", "--prompt-ids", "1"], "JSON nested too deeply"),
    ("nested trace", ["simulate", "mistral-7b", "--workload", "{T}/nested.jsonl"], "nested.jsonl:1: JSON nested too deeply"),
    # ---- inputs that would hang: refused up front, in bytes
    ("num-blocks 1e11", ["generate", "{M}", "--prompt-ids", "1", "--num-blocks", "100000000000"],
     "--num-blocks 100,000,000,000 (blocks of 16 KiB) would take 1490.12 TiB (1,638,400,000,000,000 bytes), more than "
     "the 1 GiB (1,073,741,824 bytes) available on cpu"),
    ("kv-cache-memory 1TiB", ["generate", "{M}", "--prompt-ids", "1", "--kv-cache-memory", "1TiB"],
     "--kv-cache-memory 1 TiB would take 1 TiB (1,099,511,627,776 bytes), more than the 1 GiB"),
    # ---- inputs whose message must say what to give instead
    ("memory fits no block", ["generate", "{M}", "--prompt-ids", "1", "--kv-cache-memory", "2KiB"],
     "--kv-cache-memory 2 KiB (2,048 bytes) fits 0 KV cache block(s) of 16 KiB (16,384 bytes) for this model; 2 are "
     "needed (the null block and one usable): give at least 32 KiB"),
    ("full layout fits no block", ["simulate", "llama4-scout", "--memory", "2MiB"],
     "--memory 2 MiB holds 0 block(s) of 3 MiB in the full layout of meta-llama/Llama-4-Scout-17B-16E; both layouts "
     "run, and each needs 2 blocks (the null block and one usable): give at least 6 MiB"),
    ("plan memory fits no block", ["plan", "mistral-7b", "--memory", "2MiB"], "2 MiB holds 1 block(s) of 2 MiB"),
    ("dangling safetensors", ["generate", "{T}/st-dangling", "--prompt-ids", "1"],
     "st-dangling/model.safetensors is a broken symbolic link (to {T}/gone/model.safetensors, which does not exist)"),
    ("folder safetensors", ["generate", "{T}/st-folder", "--prompt-ids", "1"], "is a folder, not a safetensors file"),
    ("empty safetensors", ["generate", "{T}/st-empty", "--prompt-ids", "1"], "st-empty/model.safetensors is empty (0 bytes)"),
    ("garbage safetensors", ["generate", "{T}/st-garbage", "--prompt-ids", "1"], "is not a complete safetensors file"),
    ("truncated safetensors", ["generate", "{T}/st-truncated", "--prompt-ids", "1"],
     "st-truncated/model.safetensors is truncated: its tensors end at byte "),
    ("absurd memory", ["plan", "mistral-7b", "--memory", "999999999999999TiB"], "is above the limit of 1024 TiB"),
    ("absurd memory simulate", ["simulate", "mistral-7b", "--memory", "2000TiB"], "above the limit of 1024 TiB"),
    ("absurd kv-cache-memory", ["generate", "{M}", "--prompt-ids", "1", "--kv-cache-memory", "9999TiB"], "above the limit"),
    ("absurd max-model-len", ["plan", "mistral-7b", "--max-model-len", "999999999T"], "above the limit of 1,099,511,627,776"),
    ("tokens 1.5x", ["plan", "mistral-7b", "--max-model-len", "1.5x"], "decimals allowed: 25.6k"),
    ("tokens 1.5M", ["simulate", "mistral-7b", "--max-model-len", "1.5M"], "did you mean 1.5m?"),
    ("tokens 1.5M generate", ["generate", "{M}", "--prompt-ids", "1", "--max-model-len", "1.5M"], "did you mean 1.5m?"),
    # ---- probed: files and folders
    ("empty config", ["plan", "{T}/empty.json"], "empty.json: not valid JSON"),
    ("binary config", ["plan", "{T}/binary.json"], "binary.json: cannot read config"),
    ("folder without config", ["generate", "{T}/no-config", "--prompt-ids", "1"], "no config.json in {T}/no-config"),
    ("weights file as model", ["generate", "{T}/weights.bin", "--prompt-ids", "1"], "weights.bin: not a GGUF file"),
    ("missing model", ["generate", "{T}/nope", "--prompt-ids", "1"], "{T}/nope does not exist"),
    ("preset as model", ["generate", "mistral-7b", "--prompt-ids", "1"], "'mistral-7b' is a plan preset"),
    ("empty trace", ["simulate", "mistral-7b", "--workload", "{T}/empty.jsonl"], "the trace holds no request"),
    ("float prompt_len", ["simulate", "mistral-7b", "--workload", "{T}/float.jsonl"], "'prompt_len' must be an int"),
    ("trace folder", ["simulate", "mistral-7b", "--workload", "{T}/trace-dir.jsonl"], "trace-dir.jsonl: not a regular file"),
    ("trace fifo", ["simulate", "mistral-7b", "--workload", "{T}/fifo.jsonl"], "fifo.jsonl: not a regular file"),
    ("trace id lone surrogate", ["simulate", "mistral-7b", "--workload", "{T}/surrogate.jsonl"],
     "surrogate.jsonl:1: 'id' must be a non-empty string of text"),
    ("prompt ids empty item", ["generate", "{M}", "--prompt-ids", "1,,2"], "--prompt-ids has an empty item in '1,,2'"),
    ("max-model-len past the model", ["generate", "{M}", "--prompt-ids", "1", "--max-model-len", "1M"],
     "exceeds the model's max_position_embeddings"),
    ("missing trace", ["simulate", "mistral-7b", "--workload", "{T}/nope.jsonl"], "cannot read trace: No such file"),
    ("unknown workload", ["simulate", "mistral-7b", "--workload", "bursty"], "unknown workload 'bursty'"),
    ("empty workload", ["simulate", "mistral-7b", "--workload", ""], "unknown workload ''"),
    ("unicode workload", ["simulate", "mistral-7b", "--workload", "工作"], "unknown workload '工作'"),
    ("unicode preset", ["plan", "模型"], "'模型' is neither a config.json file nor a preset"),
    ("unicode digits", ["plan", "mistral-7b", "--memory", "８０GiB"], "invalid memory size"),
    # ---- probed: numbers
    ("memory 0", ["plan", "mistral-7b", "--memory", "0"], "memory size must be positive"),
    ("memory negative", ["plan", "mistral-7b", "--memory=-5GiB"], "invalid memory size '-5GiB'"),
    ("memory no unit letter", ["plan", "mistral-7b", "--memory", "80G"], "ambiguous memory unit 'G'"),
    ("max-model-len 0", ["simulate", "mistral-7b", "--max-model-len", "0"], "token count must be positive"),
    ("max-model-len 1 chat", ["simulate", "mistral-7b", "--max-model-len", "1", "--workload", "chat"],
     "max_model_len must be an int >= 2 for a workload"),
    ("block-size 0", ["simulate", "mistral-7b", "--block-size", "0"], "argument --block-size: expected an integer >= 1"),
    ("block-size huge", ["plan", "mistral-7b", "--block-size", "99999999999999999999"], "holds 0 block(s)"),
    ("num-requests 0", ["simulate", "mistral-7b", "--num-requests", "0"], "expected an integer in 1..1,000,000"),
    ("num-requests huge", ["simulate", "mistral-7b", "--num-requests", "10000000000"], "in 1..1,000,000"),
    ("many requests", ["simulate", "llama4-scout", "--num-requests", "1000000"],
     "would hold about 43,720,312,500 prompt tokens; the simulator holds at most 33,554,432"),
    ("max-num-seqs 0", ["simulate", "mistral-7b", "--max-num-seqs", "0"], "argument --max-num-seqs"),
    ("batched tokens -1", ["simulate", "mistral-7b", "--max-num-batched-tokens=-1"], "argument --max-num-batched-tokens"),
    ("seed negative", ["simulate", "mistral-7b", "--seed=-1"], "argument --seed: expected an integer in 0.."),
    ("seed huge", ["generate", "{M}", "--prompt-ids", "1", "--seed", str(2**64)], "argument --seed"),
    ("max-tokens 0", ["generate", "{M}", "--prompt-ids", "1", "--max-tokens", "0"], "argument --max-tokens"),
    ("top-k negative", ["generate", "{M}", "--prompt-ids", "1", "--top-k=-1"], "argument --top-k"),
    ("top-p 0", ["generate", "{M}", "--prompt-ids", "1", "--top-p", "0"], "expected a finite number in (0, 1]"),
    ("num-blocks 1", ["generate", "{M}", "--prompt-ids", "1", "--num-blocks", "1"], "(the null block and one usable)"),
    ("blocks and memory", ["generate", "{M}", "--prompt-ids", "1", "--num-blocks", "4", "--kv-cache-memory", "1MiB"],
     "give --num-blocks or --kv-cache-memory, not both"),
    ("dtype", ["generate", "{M}", "--prompt-ids", "1", "--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    ("plan dtype", ["plan", "mistral-7b", "--dtype", "int4"], "KV cache dtype 'int4' is not supported"),
    ("max-num-seqs 0 generate", ["generate", "{M}", "--prompt-ids", "1", "--max-num-seqs", "0"], "argument --max-num-seqs"),
    ("batched 0 generate", ["generate", "{M}", "--prompt-ids", "1", "--max-num-batched-tokens", "0"],
     "argument --max-num-batched-tokens"),
    ("prompt too long", ["generate", "{M}", "--prompt-ids", "1,2,3", "--max-model-len", "2"], "exceeds max_model_len 2"),
    ("token id huge", ["generate", "{M}", "--prompt-ids", str(10**30)], "token ids must be ints in [0, 128)"),
    ("prompt ids empty", ["generate", "{M}", "--prompt-ids", " , "], "--prompt-ids needs at least one token id"),
    ("text mode small vocab", ["generate", "{M}", "--prompt", "héllo"], "a text prompt needs a tokenizer"),
    # ---- probed: missing / unknown options and commands
    ("no prompt", ["generate", "{M}"], "give at least one --prompt, --prompts-file or --prompt-ids"),
    ("missing model arg", ["generate"], "the following arguments are required: MODEL"),
    # ---- real models, text
    ("unknown model name", ["generate", "gemma-9-1b", "--prompt", "hi"], "gemma-9-1b does not exist; give an installed model"),
    ("truncated gguf", ["generate", "{T}/truncated.gguf", "--prompt", "hi"], "truncated.gguf"),
    ("not a gguf", ["generate", "{T}/not-gguf.gguf", "--prompt", "hi"], "not-gguf.gguf: not a GGUF file"),
    ("template raises", ["generate", "{T}/raising-template", "--chat", "--prompt", "hi"], "no chats here"),
    ("text prompt too long", ["generate", "{T}/with-tok", "--prompt", "hello world", "--max-model-len", "8"],
     "prompt of 13 tokens exceeds max_model_len 8"),
    ("empty prompts file", ["generate", "{T}/with-tok", "--prompts-file", "{T}/empty-prompts.txt"], "holds no prompt"),
    ("missing prompts file", ["generate", "{T}/with-tok", "--prompts-file", "{T}/nope.txt"], "nope.txt"),
    ("bad JSONL line", ["generate", "{T}/with-tok", "--prompts-file", "{T}/bad-line.jsonl"],
     "bad-line.jsonl:3: not a JSON object"),
    ("JSONL without prompt", ["generate", "{T}/with-tok", "--prompts-file", "{T}/no-key.jsonl"],
     'no-key.jsonl:2: expected an object with "prompt" or "messages"'),
    ("JSONL bad messages", ["generate", "{T}/with-tok", "--prompts-file", "{T}/bad-messages.jsonl"],
     'bad-messages.jsonl:1: "messages" must be a list'),
    ("prompts file not UTF-8", ["generate", "{T}/with-tok", "--prompts-file", "{T}/latin1.txt"], "not UTF-8 text"),
    ("system without chat", ["generate", "{T}/with-tok", "--prompt", "hi", "--system", "x"], "--system needs --chat"),
    ("chat with ids", ["generate", "{T}/with-tok", "--chat", "--prompt-ids", "1"], "--chat takes text prompts"),
    ("ids and text", ["generate", "{T}/with-tok", "--prompt", "a", "--prompt-ids", "1"], "not both"),
    ("empty stop", ["generate", "{T}/with-tok", "--prompt", "a", "--stop", ""], "stop must be non-empty strings"),
    ("stop without tokenizer", ["generate", "{M}", "--prompt-ids", "1", "--stop", "x"], "a stop string needs a tokenizer"),
    ("route max-share-ratio below 1", ["route", "--replica", "http://127.0.0.1:9", "--max-share-ratio", "0.5"],
     "max_share_ratio must be a number in [1, 1e+06]"),
    ("route max-share-ratio inf", ["route", "--replica", "http://127.0.0.1:9", "--max-share-ratio", "inf"],
     "argument --max-share-ratio: expected a finite number >= 0"),
    ("route share window 0", ["route", "--replica", "http://127.0.0.1:9", "--share-window", "0"],
     "argument --share-window"),
    ("route share window huge", ["route", "--replica", "http://127.0.0.1:9", "--share-window", "1" + "0" * 400],
     "the balance window must be an int in [1, 1,000,000]"),
    ("serve request-timeout 0", ["serve", "{M}", "--request-timeout", "0"],
     "argument --request-timeout: expected a finite number > 0, got '0'"),
    ("serve request-timeout nan", ["serve", "{M}", "--request-timeout", "nan"],
     "argument --request-timeout: expected a finite number > 0, got 'nan'"),
    ("serve max-connections 0", ["serve", "{M}", "--max-connections", "0"],
     "argument --max-connections: expected an integer >= 1, got '0'"),
    ("route request-timeout -1", ["route", "--replica", "http://127.0.0.1:9", "--request-timeout=-1"],
     "argument --request-timeout: expected a finite number > 0, got '-1'"),
    ("route request-timeout inf", ["route", "--replica", "http://127.0.0.1:9", "--request-timeout", "inf"],
     "argument --request-timeout: expected a finite number > 0, got 'inf'"),
    ("route max-connections 0", ["route", "--replica", "http://127.0.0.1:9", "--max-connections", "0"],
     "argument --max-connections: expected an integer >= 1, got '0'"),
    ("serve allowed-origins not JSON", ["serve", "{M}", "--allowed-origins", "*"],
     "argument --allowed-origins: expected a JSON list of origins"),
    ("serve allowed-origins not strings", ["serve", "{M}", "--allowed-origins", '["a", 1]'],
     "argument --allowed-origins: expected a JSON list of origins"),
    ("serve kv-events-hash", ["serve", "{M}", "--kv-events-hash", "hex"], "argument --kv-events-hash: invalid choice"),
    ("serve per-client limit, clients not told apart", ["serve", "{M}", "--max-seqs-per-client", "4"],
     "max_seqs_per_client needs clients told apart"),
    ("serve per-client tokens, one key", ["serve", "{M}", "--api-key", "k", "--max-tokens-per-client", "9"],
     "max_tokens_per_client needs clients told apart"),
    ("serve per-client limit 0", ["serve", "{M}", "--client-id-header", "X-C", "--max-seqs-per-client", "0"],
     "argument --max-seqs-per-client: expected an integer >= 1, got '0'"),
    ("serve client id header not a name", ["serve", "{M}", "--client-id-header", "X Client"],
     "client_id_header must be an HTTP header name"),
    ("serve shutdown-timeout -1", ["serve", "{M}", "--shutdown-timeout=-1"], "argument --shutdown-timeout"),
    ("serve drain-timeout nan", ["serve", "{M}", "--drain-timeout", "nan"], "argument --shutdown-timeout"),
    ("route shutdown-timeout inf", ["route", "--replica", "http://127.0.0.1:9", "--shutdown-timeout", "inf"],
     "argument --shutdown-timeout"),
    ("ray-serve replicas 0", ["ray-serve", "{M}", "--replicas", "0"], "argument --replicas"),
    ("ray-serve oracle policy", ["ray-serve", "{M}", "--policy", "oracle"], "argument --policy: invalid choice: 'oracle'"),
    ("missing value", ["plan", "mistral-7b", "--memory"], "argument --memory: expected one argument"),
    ("unknown option", ["plan", "mistral-7b", "--bogus"], "hybridkv plan: error: unrecognized arguments: --bogus"),
    ("unknown command", ["bogus"], "invalid choice: 'bogus'"),
]


def _fill(items: list[str], **paths: Path) -> list[str]:
    return [s.format(**{k: str(v) for k, v in paths.items()}) for s in items]


@pytest.fixture
def one_gib_free(monkeypatch):
    """The memory check sees 1 GiB free, whatever the machine has."""
    pytest.importorskip("torch")
    from hybridkv.engine import kv_storage

    monkeypatch.setattr(kv_storage, "available_memory", lambda device="cpu": 2**30)


@pytest.mark.parametrize("argv, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, message, tiny_llama, bad_files, one_gib_free, no_hang, capsys):
    paths = dict(M=tiny_llama, T=bad_files)
    assert main(_fill(argv, **paths)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("hybridkv")
    assert _fill([message], **paths)[0] in err


def test_generate_without_torch_says_how_to_install(tiny_llama, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    assert main(["generate", str(tiny_llama), "--prompt-ids", "1"]) == 2
    assert capsys.readouterr().err == (
        "hybridkv generate: error: generate needs torch, which is not installed: pip install 'hybridkv[engine]'\n"
    )


def test_generate_accepts_the_config_json_path(tiny_llama, capsys):
    argv = ["--prompt-ids", "1,2,3", "--max-tokens", "3"]
    assert main(["generate", str(tiny_llama), *argv]) == 0
    by_dir = capsys.readouterr().out
    assert main(["generate", str(tiny_llama / "config.json"), *argv]) == 0
    assert capsys.readouterr().out == by_dir and len(by_dir.split(",")) == 3


def test_chat_with_a_tiny_max_model_len_finishes(no_hang, capsys):
    # the chat generator used to loop forever: every first turn (>= 232 tokens) overflowed 16
    assert main(["simulate", "llama4-scout", "--max-model-len", "16", "--workload", "chat", "--num-requests", "8",
                 "--json", "--no-progress"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["finished"] for r in results] == [8, 8]


# ------------------------------------------------------------------ subprocesses
def _cli(*argv: str, stdout=subprocess.PIPE, timeout: int = HANG_SECONDS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridkv", *argv], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def _one_line_exit_2(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1 and message in proc.stderr


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="the memory check reads /proc/meminfo here")
def test_huge_pool_is_refused_not_allocated(tiny_llama):
    proc = _cli("generate", str(tiny_llama), "--prompt-ids", "1", "--num-blocks", "100000000000")
    _one_line_exit_2(proc, "(1,638,400,000,000,000 bytes), more than the ")


def test_binary_trace_has_no_traceback(bad_files):
    _one_line_exit_2(_cli("simulate", "mistral-7b", "--workload", str(bad_files / "binary.jsonl")), "not UTF-8 text")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", slow_except([["plan", "mistral-7b", "--json"],
                                              ["simulate", "mistral-7b", "--memory", "4GiB", "--num-requests", "2", "--json-series"]],
                                             0))
def test_full_disk_is_one_line(argv):
    with open("/dev/full", "w") as full:
        proc = _cli(*argv, "--no-progress" if argv[0] == "simulate" else "--json", stdout=full)
    _one_line_exit_2(proc, f"hybridkv {argv[0]}: error: cannot write the output: No space left on device")


def test_closed_pipe_is_quiet():
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "plan", "llama4-scout"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    proc.stdout.close()  # the reader went away (| head)
    _, err = proc.communicate(timeout=HANG_SECONDS)
    assert proc.returncode == 0 and err == b""


# ------------------------------------------------------------------ fuzz
_NASTY = ["", " ", "0", "-1", "1", "3", "16", "1.5", "1e9", "nan", "inf", "-inf", "0x10", "1_000", str(2**64),
          "9" * 30, "1.5k", "128k", "128K", "1M", "1.5M", "2T", "80GiB", "80GB", "80G", "2MiB", "1B", "1024TiB",
          "1025TiB", "é", "８", "\x00", "--json", "fp8", "bfloat16", "int4"]
_PLAN_OPTIONS = ["--memory", "--max-model-len", "--block-size", "--dtype"]
_SIM_OPTIONS = {
    "--memory": ["", "0", "1B", "2MiB", "64MiB", "8GiB", "nan", "1025TiB", "80G"],
    "--workload": ["chat", "long-doc", "sharegpt", "", "bursty", "x/y.jsonl"],
    "--num-requests": ["0", "1", "3", "-1", "1e3", "x", str(2**64)],
    "--max-model-len": ["1", "2", "16", "300", "4k", "1.5k", "0", "2T", "x"],
    "--block-size": ["0", "1", "7", "16", "99999999999", "-3"],
    "--max-num-batched-tokens": ["0", "64", "8192", "-5", "nan"],
    "--max-num-seqs": ["0", "1", "256", "x"],
    "--seed": ["0", "-1", "7", str(2**63), "x"],
}


def _check_outcome(code: int, out: str, err: str) -> None:
    assert code in (0, 2) and "Traceback" not in err
    if code == 2:
        assert out == "" and err.count("\n") == 1 and err.startswith("hybridkv")
    else:
        assert out and err == ""


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=st.lists(st.tuples(st.sampled_from(_PLAN_OPTIONS), st.sampled_from(_NASTY)), max_size=4),
       model=st.sampled_from(["mistral-7b", "llama4-scout", "gemma-3-27b", "gpt-oss-20b", "nope", ""]))
def test_random_plan_options_are_a_plan_or_one_line(options, model, capsys):
    argv = ["plan", model] + [f"{k}={v}" for k, v in options]
    with hang_guard():
        code = main(argv)
    _check_outcome(code, *capsys.readouterr())


@pytest.mark.slow
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(picks=st.dictionaries(st.sampled_from(sorted(_SIM_OPTIONS)), st.integers(0, 9), max_size=4),
       model=st.sampled_from(["mistral-7b", "llama4-scout", "gemma-3-27b"]))
def test_random_simulate_options_are_a_run_or_one_line(picks, model, capsys):
    argv = ["simulate", model, "--num-requests", "3", "--no-progress"]
    for key, i in picks.items():
        values = _SIM_OPTIONS[key]
        argv.append(f"{key}={values[i % len(values)]}")
    with hang_guard():
        code = main(argv)
    _check_outcome(code, *capsys.readouterr())


@pytest.mark.parametrize("module,argv,line", [
    ("httpx", ["route", "--replica", "http://127.0.0.1:9"],
     "hybridkv route: error: route needs httpx, which is not installed: pip install 'hybridkv[server]'"),
    ("numpy", ["generate", "{M}", "--prompt-ids", "1"],
     "hybridkv generate: error: generate needs numpy, which is not installed: pip install 'hybridkv[engine]'"),
    ("gguf", ["serve", "{M}"],
     "hybridkv serve: error: serve needs gguf, which is not installed: pip install 'hybridkv[engine]'"),
    ("ray", ["ray-serve", "{M}"],
     "hybridkv ray-serve: error: ray-serve needs Ray Serve, which is not installed: pip install 'hybridkv[ray]'"),
])
def test_a_missing_extra_is_one_line(module, argv, line, tiny_llama, monkeypatch, capsys):
    """A command whose extra is not installed names the extra, in one line, exit 2."""
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    argv = [a.replace("{M}", str(tiny_llama)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [line]


def test_probe_access_lines_are_debug_only():
    """uvicorn's access lines for /health and /metrics are dropped above --log-level debug."""
    import logging

    from hybridkv.cli.http_server import QuietProbes

    def record(path):
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    f = QuietProbes()
    assert not f.filter(record("/health")) and not f.filter(record("/metrics?x=1"))
    assert f.filter(record("/v1/completions")) and f.filter(record("/v1/models"))
