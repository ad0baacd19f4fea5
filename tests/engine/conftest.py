"""Shared fixtures of the engine tests: tiny HF models saved once per session."""

from __future__ import annotations


import pytest


pytest.importorskip("transformers")

from tests.support.hf_tiny import build_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> (model dir, HF model); built lazily, once per session."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, build_tiny(name, path))
        return cache[name]

    return get


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The C kernels' thread pool at 1 and at 2 threads (set back afterwards)."""
    from hybridkv.engine import cpu_ops

    ops = cpu_ops.load()
    if ops is None:
        pytest.skip(f"cpu kernels unavailable: {cpu_ops.unavailable()}")
    before = ops.get_threads()
    ops.set_threads(request.param)
    yield request.param
    ops.set_threads(before)
