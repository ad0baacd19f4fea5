"""Our tokenizers built from the two GGUF files against transformers' own (encode, decode,
streaming detokenization, SmolLM2's chat template). HF's tokenizer loads come once per session
from conftest; ours are built once per module."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hybridkv.tokenizer import IncrementalDetokenizer, check_vocab, load_tokenizer, tokenizer_from_gguf

from tests.support.texts import texts  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

pytest.importorskip("transformers")


def read_metadata(path: Path) -> dict:
    try:
        from hybridkv.checkpoint.gguf_file import GGUFFile
    except ImportError:  # Part A's reader not merged yet: the tests' tiny one
        from tests.support.gguf_metadata import read_gguf_metadata

        return read_gguf_metadata(path)
    return GGUFFile.open(path).metadata


@pytest.fixture(scope="module")
def smollm_tok(smollm_gguf):
    return tokenizer_from_gguf(read_metadata(smollm_gguf))


@pytest.fixture(scope="module")
def gemma_tok(gemma_gguf):
    return tokenizer_from_gguf(read_metadata(gemma_gguf))


@pytest.fixture(params=["smollm", "gemma"])
def pair(request):
    """(ours, transformers') for one model."""
    return request.getfixturevalue(f"{request.param}_tok"), request.getfixturevalue(f"hf_{request.param}_tokenizer")


REALISTIC = texts(300, seed=11)


def test_encode_equals_transformers(pair):
    ours, hf = pair
    for text in REALISTIC:
        assert ours.encode(text) == hf(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids, text


def test_decode_equals_transformers(pair):
    ours, hf = pair
    for text in REALISTIC[:150]:
        ids = hf(text).input_ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


def test_random_ids_decode_equals_transformers(pair):
    ours, hf = pair
    rng = random.Random(5)
    for _ in range(150):
        ids = [rng.randrange(ours.vocab_size) if rng.random() < 0.7 else rng.randrange(300) for _ in range(rng.randint(1, 20))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_special_ids_and_vocab(smollm_tok, gemma_tok, hf_smollm_tokenizer, hf_gemma_tokenizer):
    for ours, hf in ((smollm_tok, hf_smollm_tokenizer), (gemma_tok, hf_gemma_tokenizer)):
        assert ours.vocab_size == len(hf)
        assert ours.bos_token_id == hf.bos_token_id
        assert ours.eos_token_ids == (hf.eos_token_id,)
        assert ours.chat_template == hf.chat_template
        check_vocab(ours, ours.vocab_size)
    assert gemma_tok.chat_template is None and len(gemma_tok.byte_fallback_ids) == 256
    assert smollm_tok.byte_fallback_ids == frozenset()


def test_streaming_detokenizer_equals_full_decode(pair):
    ours, hf = pair
    rng = random.Random(3)
    for text in REALISTIC[:100]:
        prompt = ours.encode("Say something:")
        ids = ours.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(ours, prompt)
        out, at = [], 0
        while at < len(ids):
            step = rng.randint(1, 3)
            out.append(detok.add(ids[at : at + step]))
            at += step
        expected = hf.decode(ids, skip_special_tokens=True)
        if not expected.endswith("\ufffd"):
            assert "".join(out) == expected, text
        assert "".join(out) + detok.flush() == expected, text


def smollm_conversations(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    pool = texts(60, seed=seed)
    convs = []
    for _ in range(n):
        messages = [{"role": "system", "content": rng.choice(pool)}] if rng.random() < 0.5 else []
        for turn in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": rng.choice(pool)})
            if turn < 3 and rng.random() < 0.7:
                messages.append({"role": "assistant", "content": rng.choice(pool)})
        convs.append(messages)
    return convs


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_chat_template_equals_transformers(smollm_tok, hf_smollm_tokenizer, add_generation_prompt):
    for messages in smollm_conversations(40, seed=int(add_generation_prompt)):
        ours = smollm_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        theirs = hf_smollm_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
        ids = hf_smollm_tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        assert smollm_tok.encode(ours, add_special_tokens=False) == list(ids)


def test_load_tokenizer_from_saved_directory(tmp_path, smollm_tok, hf_smollm_tokenizer):
    """transformers' save_pretrained of the GGUF tokenizer, read back by load_tokenizer."""
    hf_smollm_tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert json.loads(loaded.backend.to_str()) == json.loads(smollm_tok.backend.to_str())
    assert loaded.chat_template == hf_smollm_tokenizer.chat_template
    assert (loaded.bos_token_id, loaded.eos_token_ids) == (smollm_tok.bos_token_id, smollm_tok.eos_token_ids)
    for text in REALISTIC[:50]:
        assert loaded.encode(text) == hf_smollm_tokenizer(text).input_ids


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_long_texts_encode_alike_and_min_tokens_is_a_lower_bound(name, request):
    """Texts past RELEASE_GIL_CHARS go through ``encode_batch`` (GIL released): the same ids as
    ``encode``; and ``min_tokens`` never exceeds the real count (random texts, every script)."""
    import random

    from hybridkv.tokenizer.hf import RELEASE_GIL_CHARS
    from hybridkv.tokenizer.prompts import min_tokens

    tok = request.getfixturevalue(f"{name}_tok")
    rng = random.Random(5)
    pieces = ["hello", " world", "\n\n", "    ", "é", "日本語", "🙂", "\t", "1234567", "=" * 40, " " * 31,
              "<start_of_turn>", "<|im_start|>", "\u0301", "ﬁ", "\x00"]
    for trial in range(4):
        text = "".join(rng.choice(pieces) for _ in range(RELEASE_GIL_CHARS // 4))
        assert len(text) >= RELEASE_GIL_CHARS
        ids = tok.encode(text)
        assert ids == tok.backend.encode(text, add_special_tokens=True).ids
        assert min_tokens(tok, len(text)) <= len(ids)
    for piece in pieces:  # the worst case: one piece repeated
        text = piece * 2000
        assert min_tokens(tok, len(text)) <= len(tok.encode(text)), piece
