"""FusedDecode: a quantized model's decode step as one C call (cpu_ops.decode_stack) runs the
same kernels in the same order as the layers' forward, so an engine with it gives the same
tokens and the same logits, bit for bit, as one without it; models it cannot describe keep the
per-layer path; a step it is handed with positions outside the tables changes nothing."""

from __future__ import annotations

import pytest
from tests.support.tiers import slow_except
import torch

from hybridkv.engine import cpu_ops
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.models import load_model
from hybridkv.engine.attention.cpu_stack import FusedDecode
from hybridkv.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason=f"cpu kernels unavailable: {cpu_ops.unavailable()}")

PROMPTS = ([5, 9, 2, 7], list(range(3, 40)), [11] * 9, list(range(50, 63)))


def _run(model, quant: str, fused: bool, max_tokens: int = 14, kv_cache_dtype: str = "auto"):
    """Greedy tokens and every step's logits of PROMPTS (two arrive later: decode steps of
    1..4 sequences, mixed steps), the fused path on or off."""
    keep = model.fused_decode
    model.fused_decode = keep if fused else None
    calls = {"n": 0}
    if keep is not None:
        run = keep.run

        def counted(*args):
            calls["n"] += 1
            return run(*args)

        keep.run = counted
    try:
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=128, max_model_len=96, quantization=quant,
                                               attention_backend="cpu", kv_cache_dtype=kv_cache_dtype))
        tokens, logits = {}, []
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=f"r{i}")
        step = 0
        while engine.has_unfinished_requests():
            if step == 3:
                for i, prompt in enumerate(PROMPTS[2:], start=2):
                    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                       request_id=f"r{i}")
            for out in engine.step():
                tokens[out.request_id] = out.output_token_ids
            engine.kv.check_invariants()
            logits.append({r: x.clone() for r, x in engine.runner.last_logits.items()})
            step += 1
        return tokens, logits, calls["n"]
    finally:
        if keep is not None:
            keep.__dict__.pop("run", None)
        model.fused_decode = keep


CASES = [(arch, quant, compute) for arch in ("llama", "gemma3") for quant in ("int8", "int4")
         for compute in (torch.bfloat16, torch.float32)]
CASES += [("mistral", "int4", torch.bfloat16), ("qwen3_plain", "int8", torch.bfloat16)]  # sliding; q/k norms
CASES = [(*case, "auto") for case in CASES]
CASES += [("gemma3", "int8", torch.float32, "bfloat16"), ("llama", "int4", torch.float32, "float16")]  # half caches


@pytest.mark.parametrize("arch,quant,compute,kv", slow_except(CASES, 4, 6, 10, multi=True))  # fast: gemma3 int8 / int4 bf16, bf16 KV
def test_fused_decode_is_the_per_layer_path_bit_for_bit(tiny_models, arch, quant, compute, kv):
    path, _ = tiny_models(arch)
    model = load_model(path)
    model.quantize_weights(quant, compute_dtype=compute)
    assert isinstance(model.fused_decode, FusedDecode), "the loader's fast path describes these layers"
    fused_tokens, fused_logits, calls = _run(model, quant, fused=True, kv_cache_dtype=kv)
    assert calls >= 10  # most steps are decode steps
    tokens, logits, _ = _run(model, quant, fused=False, kv_cache_dtype=kv)
    assert fused_tokens == tokens
    assert len(fused_logits) == len(logits)
    for a, b in zip(fused_logits, logits):
        assert a.keys() == b.keys()
        for r in a:
            assert torch.equal(a[r], b[r]), (arch, quant, r)


@pytest.mark.parametrize("arch", ["qwen2", "gpt_oss", "llama4_dense"])
def test_layers_it_cannot_describe_keep_the_per_layer_path(tiny_models, arch):
    """Qwen2's q/k/v biases, GPT-OSS's sinks and experts, Llama 4's own q/k path: no plan."""
    path, _ = tiny_models(arch)
    model = load_model(path)
    model.quantize_weights("int8")
    assert model.fused_decode is None
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_model_len=64, quantization="int8",
                                           attention_backend="cpu"))
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs[0].output_token_ids) == 4


def test_not_quantized_no_plan(tiny_models):
    path, _ = tiny_models("llama")
    model = load_model(path)
    assert model.use_cpu_kernels(True) and model.fused_decode is None  # the exact path: no fused step


def _a_decode_step(tiny_models, arch: str, quant: str):
    """A quantized ``arch`` engine run to the end; returns (model, its FusedDecode, the unpatched
    ``run``, and the first fused step's hidden (a copy), rope and meta)."""
    path, _ = tiny_models(arch)
    model = load_model(path)
    model.quantize_weights(quant)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_model_len=64, quantization=quant,
                                           attention_backend="cpu"))
    engine.add_request(list(range(3, 12)), SamplingParams(max_tokens=3, ignore_eos=True))
    fused, captured = model.fused_decode, {}
    run = fused.run

    def capture(hidden, rope, meta):
        captured.setdefault("args", (hidden.clone(), rope, meta))
        return run(hidden, rope, meta)

    fused.run = capture
    while engine.has_unfinished_requests():
        engine.step()
    return (model, fused, run, *captured["args"])


def test_a_step_outside_its_tables_changes_nothing(tiny_models):
    """decode_stack checks every layer's positions and blocks before it writes any K/V."""
    model, _, run, hidden, rope, meta = _a_decode_step(tiny_models, "gemma3", "int8")
    storage = meta.storage
    before = [storage.layer_kv(i).clone() for i in range(model.num_layers)]
    for bad in (meta.start + 10_000, meta.start * 0 - 1):
        meta.start = bad
        meta.renew_state()  # a fresh step state: the positions are read from start
        h = hidden.clone()
        with pytest.raises(ValueError, match="outside"):
            run(h, rope, meta)
        assert torch.equal(h, hidden)
        assert all(torch.equal(storage.layer_kv(i), kv) for i, kv in enumerate(before))


def test_a_plan_that_does_not_fit_together_is_refused(tiny_models):
    """decode_stack checks each layer's shapes, weights and indexes against the step first."""
    import struct

    from hybridkv.engine.attention import cpu_stack as fused_decode

    _, fused, run, hidden, rope, meta = _a_decode_step(tiny_models, "llama", "int4")
    plan = fused._layer_plan(meta.storage)
    record = fused_decode._RECORD
    good = bytes(plan.numpy())
    for field, value in ((1, 0), (1, 5), (10, 7), (16, 3), (17, 3), (20, 16), (22, 1)):  # Hkv 0 / not dividing
        # Hq, rope index, KV cache type, weight kind, int4 group, weight rows
        fields = list(record.unpack_from(good, record.size))  # the second layer
        fields[field] = value
        bad = bytearray(good)
        record.pack_into(bad, record.size, *fields)
        fused._plan = (fused._plan[0], torch.frombuffer(bad, dtype=torch.uint8))
        h = hidden.clone()
        with pytest.raises(ValueError, match="layer 1: its plan does not fit"):
            run(h, rope, meta)
        assert torch.equal(h, hidden)
    fused._plan = (fused._plan[0], plan)
    assert struct.calcsize("<17q28q2d") == record.size


def test_torch_gets_the_cores_back_when_the_engine_is_idle(tiny_models):
    """Decode steps lend the cores to the kernels (torch on one thread); once nothing is left to
    run, and in a model's steps that are not quantized decode, torch's threads are as before."""
    path, _ = tiny_models("llama")
    model = load_model(path)
    model.quantize_weights("int8")
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_model_len=64, quantization="int8",
                                           attention_backend="cpu"))
    before = torch.get_num_threads()  # as the engine set them
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True))
    lent = []
    while engine.has_unfinished_requests():
        engine.step()
        lent.append(cpu_ops._state.get("kernels", False))
    assert any(lent[:-1]) and not lent[-1]
    assert torch.get_num_threads() == before
