"""Shared fixtures of the CLI tests: a tiny HF Llama saved once per session."""

from __future__ import annotations

from pathlib import Path

import pytest



@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 4-layer Llama (vocab 128, max_position_embeddings 512) saved by transformers."""
    pytest.importorskip("transformers")
    from tests.support.hf_tiny import build_tiny

    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny("llama", path)
    return path
