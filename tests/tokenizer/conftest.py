"""Tiny tokenizers for the unit tests, built with the tokenizers library once per session.

- ``bpe_tok``: byte-level BPE (GPT-2 style) trained on a small corpus, specials like SmolLM2's,
  built through ``tokenizer_from_gguf`` from GGUF-shaped metadata (``gpt2``, tokens + merges).
- ``spm_tok``: Gemma-style SentencePiece BPE with byte fallback (``llama`` + ``gemma3``, tokens /
  scores / token types, no merges: they are derived), also from GGUF-shaped metadata.
"""

from __future__ import annotations


import pytest


pytest.importorskip("tokenizers")

from tests.support.tiny_vocab import bpe_metadata, spm_metadata  # noqa: E402

from hybridkv.tokenizer import tokenizer_from_gguf  # noqa: E402


@pytest.fixture(scope="session")
def bpe_meta():
    return bpe_metadata()


@pytest.fixture(scope="session")
def spm_meta():
    return spm_metadata()


@pytest.fixture(scope="session")
def bpe_tok(bpe_meta):
    return tokenizer_from_gguf(bpe_meta, cache=False)


@pytest.fixture(scope="session")
def spm_tok(spm_meta):
    return tokenizer_from_gguf(spm_meta, cache=False)
