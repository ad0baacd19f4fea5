"""token_bytes: each id's raw bytes from the vocabulary (what llguidance needs), and TokenSpeller.

The check is the one a grammar engine relies on: the bytes of a text's tokens, joined, are the
text's UTF-8 (less the prefix space a SentencePiece tokenizer adds before the first word), for
byte-level BPE, Gemma-style SentencePiece with byte fallback, Llama-style SentencePiece (a
``Strip`` decoder) and the tiny character tokenizer; and each id alone keeps its leading space.
"""

from __future__ import annotations

import json

import pytest

from hybridkv.errors import TokenizerError
from hybridkv.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_from_gguf
from hybridkv.tokenizer.token_bytes import TokenSpeller, token_bytes

from tests.support.tiny_vocab import spm_metadata

TEXTS = ["hello world", "  two  spaces\tand\ttabs\n\nnew lines", '{"key": [1, 2.5, true, null]}',
         "ünïcödé 世界 😀", "x", " leading", "trailing "]


def _joined(tokenizer, table, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    return b"".join(table[i] for i in ids)


@pytest.mark.parametrize("name", ["bpe_tok", "spm_tok"])
def test_joined_bytes_are_the_text(name, request):
    tok = request.getfixturevalue(name)
    table = token_bytes(tok)
    assert len(table) == tok.vocab_size
    for text in TEXTS:
        assert _joined(tok, table, text) == text.encode(), text
    # special tokens keep their text (llguidance marks them special itself)
    for i in tok.special_token_ids:
        assert table[i] == tok.convert_ids_to_tokens([i])[0].encode()


def test_sentencepiece_keeps_each_tokens_leading_space(spm_tok):
    table = token_bytes(spm_tok)
    word = spm_tok.encode(" the", add_special_tokens=False)[0]
    assert spm_tok.convert_ids_to_tokens([word])[0].startswith("\u2581") and table[word].startswith(b" ")
    byte_tokens = sorted(spm_tok.byte_fallback_ids)
    assert byte_tokens and all(len(table[i]) == 1 for i in byte_tokens)  # <0xNN> -> the byte NN


def test_llama_style_sentencepiece_and_the_strip_decoder():
    tok = tokenizer_from_gguf({**spm_metadata(), "general.architecture": "llama"}, cache=False)
    assert "Strip" in tok.backend.decoder.__getstate__().decode()
    table = token_bytes(tok)
    for text in TEXTS:
        # Metaspace prepends ▁ to the first word; the Strip decoder drops it from the whole text only
        assert _joined(tok, table, text) in (text.encode(), b" " + text.encode()), text


def test_character_tokenizer_and_padded_vocabulary(tmp_path):
    from tests.support.tiny_tokenizer import write_tokenizer

    write_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    table = token_bytes(tok, 160)
    assert len(table) == 160 and table[128:] == [b""] * 32  # ids past the tokenizer's have no bytes
    assert table[tok.encode("a", add_special_tokens=False)[-1]] == b"a" and table[6] == b" "
    assert _joined(tok, table, "ab cd") == b" ab cd"
    with pytest.raises(TokenizerError):
        token_bytes(tok, 100)


def test_byte_tokenizer_is_its_own_table():
    table = token_bytes(ByteTokenizer(300))
    assert table[:256] == [bytes((i,)) for i in range(256)] and table[256:] == [b""] * 44


def test_unknown_decoders_are_refused():
    from tokenizers import Tokenizer, decoders, models

    tok = load_like(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]")))
    tok.backend.decoder = decoders.WordPiece()
    with pytest.raises(TokenizerError, match="WordPiece"):
        token_bytes(tok)
    with pytest.raises(TokenizerError):
        token_bytes(object())


def load_like(backend):
    from hybridkv.tokenizer.hf import HFTokenizer

    return HFTokenizer(backend)


@pytest.mark.parametrize("name", ["bpe_tok", "spm_tok"])
def test_speller_spells_exactly(name, request, tmp_path):
    tok = request.getfixturevalue(name)
    table = token_bytes(tok)
    spell = TokenSpeller(tok, table, tok.special_token_ids)
    for data in [t.encode() for t in TEXTS] + [b"\xff\xfe", "é".encode()[:1] + b"abc"]:
        ids = spell(data)
        if name == "bpe_tok" or data.isascii():
            assert b"".join(table[i] for i in ids) == data, data


def test_speller_drops_the_prefix_space(tmp_path):
    from tests.support.tiny_tokenizer import write_tokenizer

    write_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    table = token_bytes(tok)
    spell = TokenSpeller(tok, table, tok.special_token_ids)
    assert tok.encode("x", add_special_tokens=False)[0] == 6  # the ▁ the pre-tokenizer adds
    for text in ["x", "ab cd", " lead"]:
        assert b"".join(table[i] for i in spell(text.encode())) == text.encode()
    assert json.dumps(spell(b"{")) == "[]"  # a byte no token spells: nothing
