"""Suite-wide settings, applied before any test module imports a library."""

from __future__ import annotations

import os

import pytest

# Triton kernels run in triton's interpreter on CPU tensors unless a GPU run asks otherwise
# (HYBRIDKV_TEST_GPU=1); the variable must be set before triton is first imported.
if os.environ.get("HYBRIDKV_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One torch thread for the whole session: the test models are tiny, and a second thread only
    adds synchronisation (on a busy 2-core machine a 16x16 matmul took 266 µs with two threads,
    12.6 µs with one). Without torch installed, nothing to set."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Gemma 3 (sliding window 12 + full layers) with a 128-id character tokenizer, saved
    once per session (the server, router and CLI tests serve it)."""
    pytest.importorskip("transformers")
    from tests.support.tiny_server import make_tiny_dir

    return make_tiny_dir(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    """The offline text front on the tiny model (``tiny_dir``), with the servers' engine settings
    (the server tests' and the router's in-process tests over the real app)."""
    from hybridkv.engine.llm import LLM
    from tests.support.tiny_server import engine_config

    return LLM(str(tiny_dir), engine_config())
