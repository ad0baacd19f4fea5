"""Fixtures of the checkpoint tests: a private tensor cache (the GGUF helpers: tests/support)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def private_tensor_cache(tmp_path, monkeypatch):
    """Every test gets its own (empty) dequantized-tensor cache folder, never ~/.cache."""
    folder = tmp_path / "hybridkv-cache"
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(folder))
    return folder
