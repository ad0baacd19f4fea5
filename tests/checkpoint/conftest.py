"""Fixtures of the checkpoint tests: the GGUF helpers on the path, a private tensor cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "engine"))  # _hf_tiny


@pytest.fixture(autouse=True)
def private_tensor_cache(tmp_path, monkeypatch):
    """Every test gets its own (empty) dequantized-tensor cache folder, never ~/.cache."""
    folder = tmp_path / "hybridkv-cache"
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(folder))
    return folder
