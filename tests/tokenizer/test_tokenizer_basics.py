"""Tokenizers from GGUF-shaped metadata, load_tokenizer, ByteTokenizer, check_vocab, bad input."""

from __future__ import annotations

import json
import os

import pytest

from hybridkv.errors import HybridKVError, InvalidArgumentError, TokenizerError
from hybridkv.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, check_vocab, load_tokenizer, tokenizer_from_gguf
from hybridkv.tokenizer.gguf_tokenizer import cache_dir, metadata_hash


def test_protocol_is_met(bpe_tok, spm_tok):
    for tok in (bpe_tok, spm_tok, ByteTokenizer()):
        assert isinstance(tok, Tokenizer)


def test_control_tokens_stay_whole_and_are_special(bpe_tok, spm_tok):
    assert bpe_tok.encode("<|im_start|>user") == [1, *bpe_tok.encode("user")]
    assert bpe_tok.decode([1, *bpe_tok.encode("user")]) == "user"
    assert bpe_tok.decode([1], skip_special_tokens=False) == "<|im_start|>"
    assert spm_tok.encode("<start_of_turn>", add_special_tokens=False) == [6]
    assert 6 in spm_tok.special_token_ids and 3 in spm_tok.special_token_ids  # control / unknown
    # user-defined ([multimodal], type 4): one token, but not special: decode keeps it
    assert spm_tok.encode("[multimodal]", add_special_tokens=False) == [5]
    assert 5 not in spm_tok.special_token_ids
    assert spm_tok.decode([5]) == "[multimodal]"


def test_bos_and_eos(bpe_tok, spm_tok):
    assert (bpe_tok.bos_token_id, bpe_tok.eos_token_ids) == (1, (2,))
    assert bpe_tok.encode("hi")[0] != 1  # add_bos_token False
    assert (spm_tok.bos_token_id, spm_tok.eos_token_ids) == (2, (1,))
    assert spm_tok.encode("hi")[0] == 2 and spm_tok.encode("hi", add_special_tokens=False)[0] != 2


def test_extra_eos_ids_from_metadata(spm_meta):
    tok = tokenizer_from_gguf({**spm_meta, "tokenizer.ggml.eot_token_id": 7}, cache=False)
    assert tok.eos_token_ids == (1, 7)


def test_spaces_tokens_are_respelled(spm_tok, spm_meta):
    two_spaces = spm_meta["tokenizer.ggml.tokens"].index("  ")
    assert spm_tok.convert_ids_to_tokens([two_spaces]) == ["\u2581\u2581"]
    assert spm_tok.decode([two_spaces]) == "  "


@pytest.mark.parametrize(
    "change, words",
    [
        ({"tokenizer.ggml.model": "bert"}, "supported: gpt2, llama"),
        ({"tokenizer.ggml.model": None}, "supported"),
        ({"tokenizer.ggml.tokens": []}, "no tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.tokens": "abc"}, "no tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.token_type": [1, 2]}, "entries for"),
        ({"tokenizer.ggml.bos_token_id": 10**9}, "outside"),
        ({"tokenizer.ggml.bos_token_id": -1}, "outside"),
    ],
)
def test_bad_metadata_is_a_tokenizer_error(spm_meta, change, words):
    with pytest.raises(TokenizerError, match=words):
        tokenizer_from_gguf({**spm_meta, **change}, cache=False)


def test_bad_merges_are_a_tokenizer_error(bpe_meta):
    with pytest.raises(TokenizerError, match="merge"):
        tokenizer_from_gguf({**bpe_meta, "tokenizer.ggml.merges": ["a b c"]}, cache=False)
    with pytest.raises(TokenizerError):
        tokenizer_from_gguf({**bpe_meta, "tokenizer.ggml.merges": ["zz qq"]}, cache=False)
    with pytest.raises(TokenizerError, match="mapping"):
        tokenizer_from_gguf([("a", 1)])


def test_llama_without_merges_or_scores(spm_meta):
    meta = {k: v for k, v in spm_meta.items() if k != "tokenizer.ggml.scores"}
    with pytest.raises(TokenizerError, match="neither merges nor scores"):
        tokenizer_from_gguf({**meta, "general.architecture": "llama"}, cache=False)
    tok = tokenizer_from_gguf({**spm_meta, "general.architecture": "llama"}, cache=False)  # merges from scores
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_check_vocab(bpe_tok):
    check_vocab(bpe_tok, bpe_tok.vocab_size)
    check_vocab(bpe_tok, bpe_tok.vocab_size + 64)  # padded embeddings are fine
    with pytest.raises(TokenizerError, match="do not belong together"):
        check_vocab(bpe_tok, bpe_tok.vocab_size - 1)
    with pytest.raises(InvalidArgumentError):
        check_vocab(bpe_tok, 0)
    check_vocab(ByteTokenizer(300), 300)
    with pytest.raises(TokenizerError):
        check_vocab(ByteTokenizer(300), 256)


def test_byte_tokenizer():
    tok = ByteTokenizer(vocab_size=260)
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode([104, 195, 169, 259]) == "hé"
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"
    assert tok.encode("\udcff") == [255]  # surrogate-escaped bytes pass through
    assert tok.convert_ids_to_tokens([65, 300 - 41]) == ["<0x41>", "<id 259>"]
    with pytest.raises(TokenizerError):
        ByteTokenizer(100)
    with pytest.raises(InvalidArgumentError):
        tok.decode([260])
    with pytest.raises(HybridKVError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("bad", [[-1], [10**6], ["a"], [1.5], [True], "abc", [None]])
def test_bad_ids_are_refused(bpe_tok, bad):
    with pytest.raises(InvalidArgumentError):
        bpe_tok.decode(bad)
    with pytest.raises(InvalidArgumentError):
        bpe_tok.convert_ids_to_tokens(bad)


def test_encode_refuses_non_text(bpe_tok):
    with pytest.raises(InvalidArgumentError):
        bpe_tok.encode(b"bytes")


def test_cache_round_trip_and_corrupt_entry(spm_meta, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("hybridkv.tokenizer.gguf_tokenizer.CACHE_MIN_TOKENS", 1)
    built = tokenizer_from_gguf(spm_meta)
    entry = cache_dir() / f"{metadata_hash(spm_meta)}.json"
    assert entry.is_file() and not list(entry.parent.glob("*.tmp"))
    cached = tokenizer_from_gguf(spm_meta)
    assert cached.backend.to_str() == built.backend.to_str()
    assert (cached.bos_token_id, cached.eos_token_ids) == (built.bos_token_id, built.eos_token_ids)
    entry.write_text(entry.read_text()[:1000])  # torn write
    rebuilt = tokenizer_from_gguf(spm_meta)
    assert rebuilt.backend.to_str() == built.backend.to_str()
    assert json.loads(entry.read_text())  # rewritten whole
    other = {**spm_meta, "tokenizer.ggml.bos_token_id": 1}
    assert metadata_hash(other) != metadata_hash(spm_meta)


def test_unwritable_cache_is_skipped(spm_meta, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(blocker))
    monkeypatch.setattr("hybridkv.tokenizer.gguf_tokenizer.CACHE_MIN_TOKENS", 1)
    assert tokenizer_from_gguf(spm_meta).decode([2]) == ""


def test_load_tokenizer_reads_config(tmp_path, bpe_tok):
    (tmp_path / "tokenizer.json").write_text(bpe_tok.backend.to_str())
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "chat_template": [{"name": "default", "template": "{{ bos_token }}x"}, {"name": "tool_use", "template": "t"}],
        "added_tokens_decoder": {"600": {"content": "<think>", "special": False, "normalized": False}},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path / "tokenizer_config.json")  # a file in the directory works too
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hi")[0] == 1 and (tok.bos_token_id, tok.eos_token_ids) == (1, (2,))
    assert tok.encode("<think>", add_special_tokens=False) == [600] and tok.vocab_size == 601
    assert tok.apply_chat_template([{"role": "user", "content": "q"}]) == "<|im_start|>x"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "q"}]) == "Jq"


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a tokenizers file"):
        load_tokenizer(tmp_path)
    os.remove(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text(ByteLevelJSON)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="JSON object"):
        load_tokenizer(tmp_path)


ByteLevelJSON = json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1}, "unk_token": "[UNK]"}})


def test_import_is_light():
    """hybridkv.tokenizer imports neither torch nor (until needed) tokenizers / jinja2."""
    import subprocess
    import sys

    code = "import sys, hybridkv.tokenizer; print(sorted(m for m in ('torch', 'tokenizers', 'jinja2') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize("seed", range(20))
def test_check_token_ids_refuses_exactly_what_is_not_an_id(seed):
    """The one token-id rule (engine, server): ints in [0, vocab); bools, floats, strings,
    negatives and ids past the vocabulary are refused, naming the parameter."""
    import random

    from hybridkv.errors import InvalidArgumentError
    from hybridkv.tokenizer.prompts import check_token_ids

    rng = random.Random(seed)
    vocab = rng.randint(1, 300)
    ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 50))]
    check_token_ids(ids, vocab)  # fine
    bad = rng.choice([-1, vocab, vocab + 7, 10**30, True, False, 1.0, "3", None])
    ids.insert(rng.randint(0, len(ids)), bad)
    with pytest.raises(InvalidArgumentError, match=r"token ids must be ints in \[0, ") as err:
        check_token_ids(ids, vocab, param="prompt")
    assert err.value.param == "prompt"
