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
