"""The attention-backend interface and registry: a new backend is a class and one registration.

A throwaway backend registered in a few lines runs the whole engine (its step state made once
per step, every attention layer through its forward) and gives the reference backend's tokens
and logits bit for bit; the registry's names, overrides, refusals and the ``auto`` rule.
"""

from __future__ import annotations

import pytest
from tests.support.tiers import slow_except
import torch

from hybridkv.engine.attention import registry
from hybridkv.engine.attention.backend import AttentionBackend
from hybridkv.engine.attention.reference import ReferenceState, reference_paged_attention
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.errors import InvalidConfigError
from hybridkv.scheduler import SamplingParams

PROMPTS = ([3, 9, 4, 17, 5, 30, 2, 8, 11, 6, 21], [3, 9, 4, 17, 5, 30, 40], [7, 1])


class CountingBackend(AttentionBackend):
    """The reference's maths, counting its steps and layer calls."""

    name = "counting"

    def __init__(self) -> None:
        self.states = 0
        self.calls = 0

    def new_state(self, meta):
        self.states += 1
        return ReferenceState(meta)

    def forward(self, query, key, value, meta, layer, attn, scale, sinks=None, softcap=None, keep=None):
        self.calls += 1
        assert isinstance(meta.state, ReferenceState) and meta.backend is self
        return reference_paged_attention(query, key, value, meta, layer, attn, scale, sinks, softcap, keep,
                                         state=meta.state)


@pytest.fixture
def counting():
    registry.register_backend("counting", CountingBackend)
    try:
        yield registry.get_backend("counting")
    finally:
        registry.unregister_backend("counting")


def _run(path, backend: str) -> tuple[list[list[int]], list[torch.Tensor], int]:
    engine = LLMEngine(path, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8,
                                          attention_backend=backend))
    rids = [engine.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in PROMPTS]
    tokens = {r: [] for r in rids}
    logits: list[torch.Tensor] = []
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.output_token_ids)
        logits += [engine.last_logits[r].clone() for r in rids if r in engine.last_logits]
        steps += 1
    return [tokens[r] for r in rids], logits, steps


@pytest.mark.parametrize("arch", slow_except(["gemma3", "gpt_oss"], 0))  # sliding + full layers; sinks
def test_a_registered_backend_runs_the_engine_as_the_reference(tiny_models, counting, arch):
    path, _ = tiny_models(arch)
    want_tokens, want_logits, steps = _run(path, "reference")
    got_tokens, got_logits, got_steps = _run(path, "counting")
    assert got_tokens == want_tokens and got_steps == steps
    assert len(got_logits) == len(want_logits) and all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    assert counting.states == steps  # one step state per step
    layers = LLMEngine(path, EngineConfig(num_blocks=8)).model.num_layers
    assert counting.calls == steps * layers  # every layer's attention went through it


def test_names_overrides_and_refusals(counting):
    assert registry.backend_names() == ("auto", "reference", "triton", "cpu", "counting")
    assert registry.resolve_backend("counting", "cpu") == "counting"
    registry.register_backend("counting", "tests.engine.test_backend_registry:CountingBackend")  # by path: replaced
    assert registry.get_backend("counting") is not counting and registry.get_backend("counting").name == "counting"
    for bad in ("", "auto", None, 3):
        with pytest.raises(InvalidConfigError, match="backend name"):
            registry.register_backend(bad, CountingBackend)
    with pytest.raises(InvalidConfigError, match="give its class"):
        registry.register_backend("other", 42)
    for bad in ("flash", "", None, "Reference"):
        with pytest.raises(InvalidConfigError, match="attention_backend must be one of"):
            registry.resolve_backend(bad, "cpu")
    with pytest.raises(InvalidConfigError, match="no attention backend named 'auto'"):
        registry.get_backend("auto")
    registry.unregister_backend("counting")
    assert "counting" not in registry.backend_names()
    registry.unregister_backend("never-registered")  # no error


class _Never(AttentionBackend):
    name = "never"

    def unavailable(self, device_type):
        return "it never runs"


def test_a_backend_that_cannot_run_is_refused_by_name_and_skipped_by_auto(monkeypatch):
    registry.register_backend("never", _Never)
    try:
        with pytest.raises(InvalidConfigError, match="attention_backend 'never' cannot run here: it never runs"):
            registry.resolve_backend("never", "cpu")
    finally:
        registry.unregister_backend("never")
    # auto: the preferred backend where it can run, else the reference
    cpu = registry.get_backend("cpu")
    monkeypatch.setattr(type(cpu), "unavailable", lambda self, device: None)
    assert registry.resolve_backend("auto", "cpu", quantized=True) == "cpu"
    assert registry.resolve_backend("auto", "cpu", quantized=False) == "reference"
    monkeypatch.setattr(type(cpu), "unavailable", lambda self, device: "no compiler")
    assert registry.resolve_backend("auto", "cpu", quantized=True) == "reference"
    triton = registry.get_backend("triton")
    monkeypatch.setattr(type(triton), "unavailable", lambda self, device: None)
    assert registry.resolve_backend("auto", "cuda") == "triton"
    monkeypatch.setattr(type(triton), "unavailable", lambda self, device: "no triton")
    assert registry.resolve_backend("auto", "cuda") == "reference"


def test_the_registry_and_the_cli_choices_import_no_torch():
    import subprocess
    import sys

    code = ("import sys; from hybridkv.engine.attention.registry import backend_names; "
            "import hybridkv.cli.engine_args; print(backend_names(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "('auto', 'reference', 'triton', 'cpu') False"
