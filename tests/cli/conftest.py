"""Shared fixtures of the CLI tests: a tiny HF Llama saved once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 4-layer Llama (vocab 128, max_position_embeddings 512) saved by transformers."""
    pytest.importorskip("transformers")
    from _hf_tiny import build_tiny

    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny("llama", path)
    return path
