"""Property tests: encode/decode round trips on random text, and the GGUF rebuild against
transformers' own converter (merges derivation, the built pipeline) on random small vocabularies."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.tiers import examples
from tests.support.tiny_vocab import bpe_metadata
from hybridkv.tokenizer import ByteTokenizer, tokenizer_from_gguf
from hybridkv.tokenizer.gguf_vocab import _merges_by_position, generate_merges, tokenizer_parts_from_gguf

SETTINGS = settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

#: emoji, CJK, combining marks, whitespace runs, newlines, special-token lookalikes
SPECIALS = ["<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "[multimodal]", "<0x41>", "<unused0>", "<|im_"]
TEXT = st.lists(
    st.one_of(
        st.text(max_size=8),
        st.text(alphabet=" \n\t\r\u00a0\u3000", max_size=6),
        st.text(alphabet="😀🎉👍🏽\u200d👨日本語中文한국\u0301\u0308e", max_size=6),
        st.sampled_from(SPECIALS),
    ),
    max_size=6,
).map("".join)


@pytest.mark.parametrize("name", ["bpe_tok", "spm_tok", "byte"])
def test_round_trip(request, name):
    tok = ByteTokenizer() if name == "byte" else request.getfixturevalue(name)

    @SETTINGS
    @given(TEXT)
    def check(text):
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < tok.vocab_size for i in ids)
        expected = text.replace("\u2581", " ") if name == "spm_tok" else text  # SentencePiece spells spaces ▁
        if any("\ud800" <= c <= "\udfff" for c in text):
            return  # lone surrogates are not text a tokenizer can keep
        if name == "spm_tok" and "<0x" in text:
            return  # text spelling a byte token merges into it and decodes as that byte (as in transformers)
        assert tok.decode(ids, skip_special_tokens=False) == expected
        with_bos = tok.encode(text)
        assert with_bos[-len(ids) :] == ids if ids else True

    check()


def test_special_lookalikes_are_whole_tokens(bpe_tok, spm_tok):
    assert bpe_tok.encode("a<|im_end|>b", add_special_tokens=False)[1] == 2
    assert bpe_tok.decode(bpe_tok.encode("a<|im_end|>b")) == "ab"
    assert 2 not in bpe_tok.encode("a<|im_end b", add_special_tokens=False)
    assert spm_tok.encode("<bos><bos>", add_special_tokens=False) == [2, 2]


# ------------------------------------------------------------ against transformers' converter

hf_base = pytest.importorskip("transformers.tokenization_utils_base")
vocabularies = st.lists(st.text(alphabet="ab▁c", min_size=1, max_size=4), min_size=1, max_size=40, unique=True)


@settings(max_examples=examples(100), deadline=None)
@given(vocabularies, st.lists(st.sampled_from([-3.0, -1.0, 0.0, 2.5]), min_size=40, max_size=40))
def test_generate_merges_equals_transformers(tokens, scores):
    vocab = {t: i for i, t in enumerate(tokens)}
    token_scores = dict(zip(tokens, scores))
    assert generate_merges(vocab, token_scores) == hf_base.generate_merges(vocab, token_scores)


@settings(max_examples=examples(100), deadline=None)
@given(vocabularies)
def test_merges_by_position_equals_transformers(tokens):
    vocab = {t: i for i, t in enumerate(tokens)}
    assert _merges_by_position(vocab) == hf_base.generate_merges(vocab, {t: -i for i, t in enumerate(tokens)})


def _hf_converted(metadata: dict) -> dict:
    """transformers' convert_gguf_tokenizer on the same metadata (its GGUF reader's renames)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
    backend, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return json.loads(backend.to_str())


@pytest.mark.parametrize("which", ["bpe", "spm", "spm-llama"])
def test_pipeline_equals_transformers_converter(which, bpe_meta, spm_meta):
    metadata = {"bpe": bpe_meta, "spm": spm_meta, "spm-llama": {**spm_meta, "general.architecture": "llama"}}[which]
    theirs = _hf_converted(metadata)
    ours = json.loads(tokenizer_from_gguf(metadata, cache=False).backend.to_str())
    for part in ("model", "normalizer", "pre_tokenizer", "decoder"):
        assert ours[part] == theirs[part], part
    # transformers' tokenizer class adds the named ones after converting; LlamaTokenizer's defaults
    # <s> </s> appear (with new ids) only for a vocabulary that lacks them, which real llama files have
    named = ("<unk>", "<pad>", "<bos>", "<eos>", "<s>", "</s>")

    def added(data: dict) -> list[dict]:
        return [t for t in data["added_tokens"] if t["content"] not in named]

    assert added(ours) == added(theirs) and added(ours)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o"])
def test_pre_tokenizer_splits_equal_transformers(pre, bpe_meta):
    metadata = {**bpe_meta, "tokenizer.ggml.pre": pre}
    ours = json.loads(tokenizer_from_gguf(metadata, cache=False).backend.to_str())
    assert ours["pre_tokenizer"] == _hf_converted(metadata)["pre_tokenizer"]


def test_control_token_outside_byte_alphabet_is_skipped(bpe_meta):
    """A 'control' token a byte-level vocabulary cannot spell is a llama.cpp mislabel (transformers skips it)."""
    tokens = [*bpe_meta["tokenizer.ggml.tokens"][:-1], "<ctrl é>"]
    types = [*bpe_meta["tokenizer.ggml.token_type"][:-1], 3]
    parts = tokenizer_parts_from_gguf({**bpe_meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    assert "<ctrl é>" not in dict(parts.added)


def test_tiny_vocab_builds(bpe_meta):
    assert bpe_metadata(vocab_size=300)["tokenizer.ggml.tokens"][:3] == bpe_meta["tokenizer.ggml.tokens"][:3]


def test_unknown_and_unused_token_types(spm_meta):
    """Types 2 (unknown), 5 (unused), 6 (byte) and unlisted values stay plain vocabulary entries."""
    types = list(spm_meta["tokenizer.ggml.token_type"])
    types[-3] = 0  # not a llama.cpp type at all
    tok = tokenizer_from_gguf({**spm_meta, "tokenizer.ggml.token_type": types}, cache=False)
    unused = len(types) - 2
    assert unused not in tok.special_token_ids and tok.decode([unused]) == "<unused0>"
    assert tok.decode([len(types) - 3]) == "  "
    no_types = {k: v for k, v in spm_meta.items() if k != "tokenizer.ggml.token_type"}
    assert tokenizer_from_gguf(no_types, cache=False).special_token_ids == {0, 1, 2, 3}  # the named ones
