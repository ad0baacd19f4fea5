"""``kv_cache_dtype`` (``--kv-cache-dtype``): the KV cache's dtype apart from the model's.

One rule (:func:`hybridkv.core.specs.kv_cache_dtype`): "auto" stores the model's dtype, any
other name is stored as such. The pool, its byte arithmetic (layout, summary, ``plan``) and every
attention path follow; an fp32 model over a bf16 / fp16 cache computes its attention in fp32 over
the stored values. Here: the rule, the pool's bytes, the hybrid layout against the all-full one
at each cache dtype (identical tokens: the layouts differ in where KV lives, not in what it holds),
the ``cpu`` backend's C decode against the reference path, and the CLI.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.tiers import slow_except

from hybridkv.core.specs import kv_cache_dtype
from hybridkv.engine import cpu_ops
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.models import load_model
from hybridkv.errors import InvalidConfigError, InvalidSpecError
from hybridkv.scheduler import SamplingParams

HALF = [torch.bfloat16, torch.float16]
NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def test_the_rule():
    assert kv_cache_dtype("auto", "float32") == "float32"
    assert kv_cache_dtype("auto", "bf16") == "bfloat16"
    assert kv_cache_dtype("auto", None) is None  # plan: the config's, not known here
    assert kv_cache_dtype("bf16", "float32") == "bfloat16"
    assert kv_cache_dtype("fp8", "bfloat16") == "fp8"  # plan's sizes know fp8; the engine's flag does not offer it
    with pytest.raises(InvalidSpecError, match="unknown dtype 'int3'"):
        kv_cache_dtype("int3", "float32")
    assert EngineConfig().kv_dtype == "float32"
    assert EngineConfig(dtype="bfloat16").kv_dtype == "bfloat16"
    assert EngineConfig(dtype="bfloat16", kv_cache_dtype="float32").kv_dtype == "float32"
    assert EngineConfig(kv_cache_dtype="float16").kv_dtype == "float16"
    for bad in ("fp8", "bf16", None, 16):
        with pytest.raises(InvalidConfigError, match="kv_cache_dtype must be one of"):
            EngineConfig(kv_cache_dtype=bad)


@pytest.fixture(scope="module")
def models(tiny_models):
    cache: dict = {}

    def get(arch, quant=None):
        if (arch, quant) not in cache:
            model = load_model(tiny_models(arch)[0])
            if quant:
                model.quantize_weights(quant, compute_dtype=torch.float32)
            cache[arch, quant] = model
        return cache[arch, quant]

    return get


def test_the_pool_and_its_bytes_follow_the_cache_dtype(models):
    model = models("gemma3")
    engines = {d: LLMEngine(model, EngineConfig(kv_cache_memory="2MiB", kv_cache_dtype=d, max_model_len=128))
               for d in ("auto", "bfloat16", "float16")}
    full = engines["auto"]
    assert full.storage.dtype == torch.float32 and model.weight_dtype == torch.float32
    for name in ("bfloat16", "float16"):
        half = engines[name]
        assert half.storage.dtype == getattr(torch, name)
        assert half.layout.bytes_per_block * 2 == full.layout.bytes_per_block
        assert half.storage.bytes_per_block * 2 == full.storage.bytes_per_block
        assert half.kv_cache_config.num_blocks == 2 * full.kv_cache_config.num_blocks  # (within the one block floored)
        assert {g.spec.dtype for g in half.kv_cache_config.groups} == {name}


PROMPTS = [list(range(3, 66)), [7, 1, 9] * 15, list(range(20, 31))]


def _greedy(model, **config):
    """Tokens and per-step logits of PROMPTS (the third arrives later), greedy, 10 tokens each."""
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=160, max_model_len=128, **config))
    tokens, logits = {}, {}
    for i in range(2):
        engine.add_request(PROMPTS[i], SamplingParams(max_tokens=10, ignore_eos=True), request_id=str(i))
    step = 0
    while engine.has_unfinished_requests():
        if step == 3:
            engine.add_request(PROMPTS[2], SamplingParams(max_tokens=10, ignore_eos=True), request_id="2")
        for out in engine.step():
            tokens[out.request_id] = list(out.output_token_ids)
        for rid, row in engine.last_logits.items():
            logits.setdefault(rid, []).append(row.clone())
        engine.scheduler.check_invariants()
        step += 1
    return tokens, {k: torch.stack(v) for k, v in logits.items()}


@pytest.mark.parametrize("arch", slow_except(["gemma3", "mistral", "llama4_dense"], 0))
@pytest.mark.parametrize("kv_dtype", HALF, ids=str)
def test_hybrid_equals_all_full_at_each_cache_dtype(models, arch, kv_dtype):
    """Windows / chunks freed or kept, the same stored values are read: identical tokens, logits
    within float noise; and the half cache really is what was read (its logits differ from fp32's).
    The noise: the layouts' attention sums in another order (~1e-6 in fp32), and a K/V that
    differs by an fp32 ulp may round to the neighbouring half value (~1e-3 relative): measured
    5.6e-5 (bf16) and 3.1e-4 (fp16) on llama4_dense's logits of magnitude ~6, hence 2e-3."""
    model = models(arch)
    name = NAMES[kv_dtype]
    h_tokens, h_logits = _greedy(model, kv_cache_dtype=name)
    f_tokens, f_logits = _greedy(model, kv_cache_dtype=name, hybrid=False)
    assert h_tokens == f_tokens
    for rid in h_logits:
        torch.testing.assert_close(h_logits[rid], f_logits[rid], atol=2e-3, rtol=0)
    _, fp32_logits = _greedy(model)
    assert max((h_logits[r] - fp32_logits[r]).abs().max().item() for r in h_logits) > 1e-6


@pytest.mark.skipif(cpu_ops.load() is None, reason=f"cpu kernels unavailable: {cpu_ops.unavailable()}")
@pytest.mark.parametrize("kv_dtype", slow_except(HALF, 0), ids=str)
def test_the_c_decode_over_a_half_cache_is_the_reference_path(models, kv_dtype):
    """int8 weights: the ``cpu`` backend (its fused decode step: the C attention reading and
    writing the half cache) against the reference backend (torch's ``.to(dtype)`` writes, fp32
    attention over the gathered values): the same tokens, logits within the kernels' rounding
    (amplified as in the layouts' test: a K/V an fp32 ulp apart may round to the next half value)."""
    model = models("gemma3", "int8")
    name = NAMES[kv_dtype]
    c_tokens, c_logits = _greedy(model, kv_cache_dtype=name, quantization="int8", attention_backend="cpu")
    r_tokens, r_logits = _greedy(model, kv_cache_dtype=name, quantization="int8", attention_backend="reference")
    assert c_tokens == r_tokens
    for rid in c_logits:
        torch.testing.assert_close(c_logits[rid], r_logits[rid], atol=2e-3, rtol=0)


def test_the_cli_offers_it_and_plan_follows_the_rule(capsys):
    from hybridkv.cli import main

    assert main(["generate", "--help"]) == 0
    assert "--kv-cache-dtype {auto,float32,bfloat16,float16}" in capsys.readouterr().out
    assert main(["generate", "--kv-cache-dtype", "fp8", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "Traceback" not in err
    per_layer = {}
    for flags in (["--dtype", "float32"], ["--dtype", "float32", "--kv-cache-dtype", "bf16"], []):
        assert main(["plan", "gemma-3-270m", "--max-model-len", "4096", *flags]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("kv cache"))
        per_layer[" ".join(flags)] = line
    assert "float32, block size 16 -> 32 KiB" in per_layer["--dtype float32"]
    assert "bfloat16, block size 16 -> 16 KiB" in per_layer["--dtype float32 --kv-cache-dtype bf16"]
    assert "bfloat16" in per_layer[""]  # auto, no --dtype: the config's, as vLLM
