"""Weight-only int8 / int4 quantization: each quantized linear against its dequantized weight,
the rounding bound, embedding rows, group sizes, and the model / engine / CLI surface."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples, slow_except

from hybridkv.engine.loading.quantize_weights import compute_dtype_here
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.models import load_model
from hybridkv.engine.layers.quantized_linear import Int4Weight, Int8Weight, int4_group_size, quantize_weight
from hybridkv.errors import InvalidConfigError


def _as_multiplied(x: torch.Tensor, group: int = 0) -> torch.Tensor:
    """x as the quantized linears multiply it: rows of a decode-sized input (the C kernels) rounded
    as the build does (cpu_ops.rounded_rows: int16 steps on AVX2, none elsewhere); a larger input
    (a dense GEMM) as it is."""
    from hybridkv.engine import cpu_ops
    from hybridkv.engine.layers.quantized_linear import KERNEL_ROWS

    if x.shape[0] > KERNEL_ROWS or cpu_ops.load() is None:
        return x
    return cpu_ops.rounded_rows(x, group).float()


def _weights(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3  # rows of different scales
    return w, torch.randn(5, k, generator=gen)


@settings(max_examples=examples(25), deadline=None)
@given(st.integers(1, 300), st.integers(1, 96), st.integers(0, 10**6))
def test_int8_linear_equals_its_dequantized_weight(n, k, seed):
    w, x = _weights(n, k, seed)
    q = Int8Weight(w, torch.float32)
    deq = q.dequantize()
    # rounding: at most half a step per element, the step being the row's max / 127
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((w - deq).abs() <= step / 2 + 1e-6).all()
    bias = torch.randn(n)
    torch.testing.assert_close(q.linear(x, bias), _as_multiplied(x) @ deq.t() + bias, atol=1e-4, rtol=1e-4)
    ids = torch.tensor([0, n - 1, n // 2])
    torch.testing.assert_close(q.rows(ids), deq[ids])


@settings(max_examples=examples(25), deadline=None)
@given(st.integers(1, 200), st.sampled_from([32, 64, 128]), st.integers(1, 4), st.integers(0, 10**6))
def test_int4_linear_equals_its_dequantized_weight(n, group, groups, seed):
    k = group * groups
    w, x = _weights(n, k, seed)
    q = Int4Weight(w, group, torch.float32)
    deq = q.dequantize()  # what the kernel multiplies by
    wg = w.view(n, groups, group)
    step = (wg.amax(2) - wg.amin(2)).repeat_interleave(group, 1) / 15
    assert ((w - deq).abs() <= step / 2 + 1e-5).all()
    torch.testing.assert_close(q.linear(x, None), _as_multiplied(x, group) @ deq.t(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q.dense(), deq, atol=1e-5, rtol=1e-5)
    ids = torch.tensor([n - 1, 0])
    torch.testing.assert_close(q.rows(ids), deq[ids], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", ["int8", "int4"])
def test_large_inputs_run_on_the_dense_weight(cls):
    """Past KERNEL_ROWS rows (a prefill chunk) the dequantized weight and a dense GEMM: same values."""
    from hybridkv.engine.layers.quantized_linear import KERNEL_ROWS

    w, _ = _weights(48, 64, 7)
    q = quantize_weight(w, cls, torch.float32, group=32)
    x = torch.randn(KERNEL_ROWS + 9, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(q.linear(x, None), x @ q.dequantize().t(), atol=1e-4, rtol=1e-4)
    small = _as_multiplied(x[:3], 32 if cls == "int4" else 0)
    torch.testing.assert_close(q.linear(x[:3], None), small @ q.dequantize().t(), atol=1e-4, rtol=1e-4)


def test_bf16_activations():
    w, x = _weights(64, 128, 1)
    for q in (Int8Weight(w, torch.bfloat16), Int4Weight(w, 64, torch.bfloat16)):
        got = q.linear(x.bfloat16(), None)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), x @ q.dequantize().t(), atol=0.1, rtol=2e-2)


def test_group_sizes_and_errors():
    assert int4_group_size([640, 2048, 1024]) == 32  # Gemma 3 270M
    assert int4_group_size([576, 1536]) == 32  # SmolLM2-135M
    with pytest.raises(InvalidConfigError, match="multiple of 32; this model has 100: use --quantization int8"):
        int4_group_size([64, 100])
    with pytest.raises(InvalidConfigError, match="quantization must be one of int8, int4, gguf; got 'int3'"):
        quantize_weight(torch.zeros(2, 32), "int3", torch.float32)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("arch", slow_except(["llama", "gemma3", "qwen2", "gpt_oss"], 1))  # the fast tier: gemma3
def test_quantized_model_equals_the_exact_path_on_dequantized_weights(arch, mode, tiny_models):
    """The quantized engine computes what the exact engine computes with every quantized matrix
    replaced by its dequantized values (logits within 1e-4 relative); the full-precision copies
    are freed and a tied output projection shares the embedding's codes."""
    path, _ = tiny_models(arch)
    quant = load_model(path)
    quant.quantize_weights(mode, compute_dtype=torch.float32)  # exact arithmetic: compare with fp32
    assert quant.quantization == mode and quant.model.embed_tokens.weight.numel() == 0
    assert all(p.numel() == 0 for n, p in quant.named_parameters() if n.endswith("proj.weight"))
    if quant.tie_word_embeddings:
        assert quant.lm_head.packed is quant.embed_quant
    fake = load_model(path)  # exact path, weights overwritten by the quantized ones' values
    with torch.no_grad():
        for m in fake.modules():
            if m is fake or not callable(getattr(m, "quant_targets", None)):
                continue
            for attr, w in m.quant_targets():
                if not (m is fake.lm_head and fake.tie_word_embeddings):
                    w.copy_(getattr(_module_named(quant, fake, m), attr).dequantize())
        emb = fake.model.embed_tokens.weight
        emb.copy_(quant.embed_quant.rows(torch.arange(emb.shape[0])))
    prompt = list(range(3, 40))
    logits = []
    for model, q in ((fake, None), (quant, mode)):
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_model_len=64, quantization=q))
        engine.add_request(prompt)
        engine.step()
        logits.append(engine.last_logits["req-0"])
    rel = ((logits[0] - logits[1]).norm() / logits[0].norm()).item()
    assert rel < 1e-4, rel
    with pytest.raises(InvalidConfigError, match="already quantized"):
        quant.quantize_weights("int8")
    fast = load_model(path, quantization=mode)  # the default: the CPU's compute dtype (bf16 where native)
    assert fast.embed_quant.rows(torch.tensor([1])).dtype == compute_dtype_here()
    engine = LLMEngine(fast, EngineConfig(block_size=4, num_blocks=64, max_model_len=64, quantization=mode))
    engine.add_request(prompt)
    engine.step()
    assert engine.last_logits["req-0"].dtype == torch.float32 and torch.isfinite(engine.last_logits["req-0"]).all()


def _module_named(quant, fake, module):
    """``quant``'s module at the path ``module`` has in ``fake``."""
    name = next(n for n, m in fake.named_modules() if m is module)
    return quant.get_submodule(name)


def test_engine_refuses_bad_quantization_before_loading(tiny_models, tmp_path):
    path, _ = tiny_models("llama")
    with pytest.raises(InvalidConfigError, match="got 'int3'"):
        LLMEngine(tmp_path / "nothing-here", EngineConfig(quantization="int3"))
    with pytest.raises(InvalidConfigError, match="runs on a CPU"):
        LLMEngine(tmp_path / "nothing-here", EngineConfig(quantization="int8", device="cuda"))
    with pytest.raises(InvalidConfigError, match="not quantized; the config asks int8"):
        LLMEngine(load_model(path), EngineConfig(quantization="int8", num_blocks=16))
