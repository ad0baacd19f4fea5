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


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One torch thread, as the engine tests (tiny models; the CI machine has 2 busy cores)."""
    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except ImportError:
            yield
            return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
