"""The final-form cache of GGUF models (bf16, int8, int4): written instead of the fp32 cache,
read back to the same model, rebuilt when damaged; the load's progress bar only on a terminal."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from tests.support.gguf_tiny import write_like_llama_cpp
from tests.support.hf_tiny import build_tiny
from tests.support.tiers import slow_except

from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.models import load_model
from hybridkv.engine.loading.weights import progress
from hybridkv.scheduler import SamplingParams


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-llama")
    return write_like_llama_cpp(build_tiny("llama", folder / "hf"), "llama", folder / "model.gguf")


def _tokens(model, dtype, quantization):
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_model_len=64, dtype=dtype,
                                           quantization=quantization))
    return engine.generate([list(range(3, 30))], SamplingParams(max_tokens=8))[0].output_token_ids, engine


@pytest.mark.parametrize("dtype,quantization", slow_except([("bfloat16", None), ("float32", "int8"), ("float32", "int4")], 0, multi=True))
def test_final_form_round_trip(gguf_path, private_tensor_cache, monkeypatch, dtype, quantization):
    cold = load_model(gguf_path, dtype=dtype, quantization=quantization)
    files = sorted(p.name for p in private_tensor_cache.glob("*.safetensors"))
    assert len(files) == 1 and "-final-" in files[0]  # no fp32 cache beside it

    def no_gguf(*args, **kwargs):
        raise AssertionError("a warm load read the GGUF tensors")

    monkeypatch.setattr("hybridkv.engine.models.base.checkpoint_tensors", no_gguf)
    warm = load_model(gguf_path, dtype=dtype, quantization=quantization)
    assert warm.quantization == quantization
    for name, t in cold.state_dict().items():
        assert torch.equal(t, warm.state_dict()[name]), name
    want, engine_a = _tokens(cold, dtype, quantization)
    got, engine_b = _tokens(warm, dtype, quantization)
    assert got == want
    assert torch.equal(engine_a.last_logits["req-0"], engine_b.last_logits["req-0"])


def test_a_damaged_final_cache_is_rebuilt(gguf_path, private_tensor_cache):
    load_model(gguf_path, quantization="int8")
    (path,) = private_tensor_cache.glob("*-final-*.safetensors")
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated
    again = load_model(gguf_path, quantization="int8")  # the truncated file removed, rebuilt
    assert again.quantization == "int8" and path.stat().st_size == len(good)
    warm = load_model(gguf_path, quantization="int8")
    assert all(torch.equal(t, warm.state_dict()[n]) for n, t in again.state_dict().items())


def test_fp32_keeps_the_dequantized_cache(gguf_path, private_tensor_cache):
    load_model(gguf_path)
    names = [p.name for p in private_tensor_cache.glob("*.safetensors")]
    assert len(names) == 1 and "-final-" not in names[0]


def test_progress_bar_only_on_a_terminal(monkeypatch):
    items = list(range(5))
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # piped: the items as they are
    assert progress(items, "loading") is items
    pytest.importorskip("tqdm")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert list(progress(items, "loading x")) == items
    assert "loading x" in tty.getvalue()
    monkeypatch.setenv("HYBRIDKV_PROGRESS", "0")
    assert progress(items, "loading") is items


def test_the_compute_dtype_has_its_own_final_form(gguf_path, private_tensor_cache, monkeypatch):
    """A CPU with native bf16 computes a quantized model in bf16, one without in fp32 (the bf16
    rule): a cache folder shared by both keeps one final form of each, named by it."""
    from hybridkv.engine.cpu_ops import isa

    forms = {}
    for level, native in (("avx512_bf16", True), ("avx2", False)):
        monkeypatch.setattr(isa, "cpu_isa", lambda level=level, native=native: isa.CpuIsa(level, native))
        for _ in range(2):  # cold, then warm from its own file
            model = load_model(gguf_path, quantization="int8")
            forms[level] = model.embed_quant.scales.dtype
    assert forms == {"avx512_bf16": torch.bfloat16, "avx2": torch.float32}
    names = sorted(p.name for p in private_tensor_cache.glob("*-final-*.safetensors"))
    assert len(names) == 2 and names[0].endswith("-int8-bfloat16.safetensors") and names[1].endswith("-int8-float32.safetensors")
