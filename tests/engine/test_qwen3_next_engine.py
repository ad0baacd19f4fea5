"""Qwen3-Next and Qwen3.5 through LLMEngine: the scheduler, the hybrid KV cache manager with
state groups, and the runner's states, against transformers' greedy generate token for token.

Every scenario runs two rounds of prompts through one engine, checking the KV cache's and
the scheduler's invariants after every step. Round 1 has two prompts sharing two blocks (the
second waits a step for the first's checkpoint); round 2 continues round 1's prompts (a
prompt again, a prompt plus its output, a cut prompt), so state checkpoints are hit: the
hit lengths asserted are the module docstring's of :mod:`hybridkv.core.managers.state`
(block 16: the engine raised the requested 4 to hold a state page).
"""

from __future__ import annotations

import json

import pytest
import torch

tf = pytest.importorskip("transformers")

from tests.support.hf_tiny import hf_generate  # noqa: E402
from tests.support.qwen3_next_tiny import build_qwen3_next  # noqa: E402
from tests.support.tiny_tokenizer import write_tokenizer  # noqa: E402

from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.models import load_model  # noqa: E402
from hybridkv.engine.state_runner import state_slots  # noqa: E402
from hybridkv.errors import InvalidConfigError, InvariantViolation  # noqa: E402
from hybridkv.scheduler.interface import SamplingParams  # noqa: E402

MAX_NEW = 8
BASE = dict(block_size=4, max_model_len=256)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


#: round 1: lengths 44, 25, 60, 17 and a 38-token prompt sharing 36 tokens with the first
ROUND1 = [_ids(44, 1), _ids(25, 2), _ids(60, 3), _ids(17, 4)]
ROUND1.append(ROUND1[0][:36] + [5, 6])


def round2(outputs: list[list[int]]) -> list[list[int]]:
    """Prompts continuing round 1's: (prompt 0 + 5 new, prompt 1 + its output + 3 new, prompt 2's
    first 35 + 6 new, prompt 3 again, a fresh one)."""
    return [ROUND1[0] + [7] * 5, ROUND1[1] + outputs[1] + [8, 9, 10], ROUND1[2][:35] + [11] * 6, ROUND1[3],
            _ids(30, 5)]


#: the hits of round 2: retention 0 caches a prompt's last checkpoint ((P - 1) // 16 * 16: 32, 16,
#: 48, 16); dense retention every step end on a boundary (prefill chunks are cut there, decodes pass them)
HITS = {0: [32, 16, 0, 16, 0], None: [32, 32, 32, 16, 0]}

SCENARIOS = {
    "retention0": dict(),
    "dense_chunked": dict(prefix_cache_retention_interval=None, max_num_batched_tokens=20),
    "no_caching_chunked": dict(enable_prefix_caching=False, max_num_batched_tokens=24),
    "small_pool": dict(num_blocks=20, max_num_batched_tokens=32),
    # every linear layer in one state group (one StateMetadata), the full group padded
    "group_size_3": dict(group_size=3),
    # the server's default: queued requests pin the prefix they will hit (two run at once)
    "queued_pin": dict(queued_prefix="pin", max_num_seqs=2),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (model dir, HF model, our model, HF's outputs memo)."""
    cache = {}

    def get(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            hf = build_qwen3_next(name, path)
            cache[name] = (path, hf, load_model(path), {})
        return cache[name]

    return get


def _want(tiny_model, prompt: list[int]) -> list[int]:
    _, hf, _, memo = tiny_model
    key = tuple(prompt)
    if key not in memo:
        memo[key] = hf_generate(hf, prompt, MAX_NEW)[0]
    return memo[key]


def _run(engine: LLMEngine, prompts: list[list[int]]):
    """Every prompt to the end, the invariants checked after every step; outputs in prompt order."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW)) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
        engine.kv.check_invariants()
        engine.scheduler.check_invariants()
    return [done[i] for i in ids]


def _triton_runs() -> bool:
    try:
        from hybridkv.engine.attention.triton_kernels import triton_unavailable
    except ImportError:
        return False
    return triton_unavailable("cpu") is None


#: the attention layers through the triton kernels too (the interpreter on a CPU): two scenarios
# the fast tier: linear_last, retention 0; the full suite: every scenario on both models
CASES = [(n, s, "reference") if (n, s) == ("linear_last", "retention0")
         else pytest.param(n, s, "reference", marks=pytest.mark.slow)
         for n in ("linear_last", "qwen3_5") for s in SCENARIOS]
CASES += [pytest.param("linear_last", s, "triton", marks=pytest.mark.slow)
          for s in ("dense_chunked", "small_pool") if _triton_runs()]


@pytest.mark.parametrize("name,scenario,backend", CASES)
def test_engine_equals_transformers(tiny, name, scenario, backend):
    model = tiny(name)
    engine = LLMEngine(model[2], EngineConfig(**BASE, **SCENARIOS[scenario], attention_backend=backend))
    assert engine.block_size == 16
    assert engine.grouping.group_size == (3 if scenario == "group_size_3" else 1)
    first = _run(engine, ROUND1)
    assert [list(o.output_token_ids) for o in first] == [_want(model, p) for p in ROUND1]
    prompts = round2([list(o.output_token_ids) for o in first])
    second = _run(engine, prompts)
    assert [list(o.output_token_ids) for o in second] == [_want(model, p) for p in prompts]
    hits = [o.num_cached_tokens for o in second]
    preemptions = engine.scheduler.num_preemptions
    print(f"{name} {scenario}: round 1 hits {[o.num_cached_tokens for o in first]}, round 2 {hits}, "
          f"preemptions {preemptions}")
    cfg = engine.config
    if not cfg.enable_prefix_caching:
        assert hits == [0] * 5 and all(o.num_cached_tokens == 0 for o in first)
    elif scenario == "small_pool":
        assert preemptions > 0
    else:
        assert hits == HITS[cfg.prefix_cache_retention_interval]
        assert first[4].num_cached_tokens == 32  # prompt 0's checkpoint after 32 tokens, a step later
        assert preemptions == 0


def test_layout_pool_and_summary(tiny):
    """The layout module's worked example: block 4 asked -> 16; 1 full group + 3 state groups of
    one layer; 4096 bytes a block id in the pool's accounting, 7296 allocated (one state pool)."""
    _, _, ours, _ = tiny("linear_last")
    engine = LLMEngine(ours, EngineConfig(**BASE, num_blocks=50))
    assert [(g.spec.kind, g.layers) for g in engine.grouping.groups] == [
        ("full_attention", (1,)), ("mamba", (0,)), ("mamba", (2,)), ("mamba", (3,))]
    assert engine.kv_cache_config.groups[1].layer_names == ("model.layers.0.state",)
    assert engine.grouping.bytes_per_block == 4096 and engine.layout.allocation_bytes(1) == 4096 + 3200
    assert engine.states is not None and engine.states.storage.nbytes == 50 * 3200
    assert engine.storage.layer_to_group_position == {1: (0, 0)}
    s = engine.kv_summary()
    assert (s.kv_bytes_per_request, s.state_bytes_per_request) == ((16 + 3 * 2) * 4096, 3 * 2 * 4096)
    assert s.full_kv_bytes_per_request == s.kv_bytes_per_request and s.full_over_layout == 1.0
    assert {g.label for g in s.groups} == {"full", "state"}
    # the default pool: 64 requests of 256 tokens, 22 block ids each
    assert LLMEngine(ours, EngineConfig(**BASE)).kv_cache_config.num_blocks == 64 * 22 + 1
    # the all-full layout keeps state layers as states: the same groups, the same outputs
    full = LLMEngine(ours, EngineConfig(**BASE, hybrid=False))
    assert [g.spec for g in full.grouping.groups] == [g.spec for g in engine.grouping.groups]
    assert [list(o.output_token_ids) for o in _run(full, ROUND1[:2])] == [_want(tiny("linear_last"), p)
                                                                        for p in ROUND1[:2]]


def test_retention_interval_is_checked(tiny):
    _, _, ours, _ = tiny("linear_last")
    with pytest.raises(InvalidConfigError, match="multiple of the block size 16"):
        LLMEngine(ours, EngineConfig(**BASE, prefix_cache_retention_interval=8))
    engine = LLMEngine(ours, EngineConfig(**BASE, prefix_cache_retention_interval=32, max_num_batched_tokens=16))
    out = _run(engine, [ROUND1[2], ROUND1[2][:40] + [3]])
    assert out[1].num_cached_tokens == 32  # every 32 tokens (and the prompt's last, 48)


def test_state_slots_refuse_the_null_block():
    assert state_slots([0, 0, 9], 40, 1, 16) == (9, 9)
    with pytest.raises(InvariantViolation, match="null block"):
        state_slots([0, 7, 0], 30, 4, 16)


def test_cli_generate_text_and_summary(tiny, capsys):
    from hybridkv.cli import main

    model = tiny("linear_last")
    path = model[0]
    write_tokenizer(path)
    assert main(["generate", str(path), "--prompt", "hello world", "--prompt", "hello there", "--json",
                 "--max-tokens", str(MAX_NEW), "--block-size", "4", "--max-model-len", "256"]) == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["output_ids"] for r in records] == [_want(model, r["prompt_ids"]) for r in records]
    summary = captured.err.strip().splitlines()[-1]
    print(summary)
    assert "KV blocks peak full " in summary and ", state 3x" in summary
    assert "KV+state/request at 256 tokens 88 KiB (24 KiB state) hybrid vs 88 KiB (24 KiB state) all-full" in summary


@pytest.mark.parametrize("interval, code", [("all", 0), ("16", 0), ("5", 2), ("-1", 2), ("x", 2)])
def test_cli_retention_interval(tiny, capsys, interval, code):
    """``--prefix-cache-retention-interval``: all, a multiple of the (unified) block size, or
    one line and exit 2 (argparse for non-ints, the core for a non-multiple)."""
    from hybridkv.cli import main

    model = tiny("linear_last")
    path = model[0]
    write_tokenizer(path)
    args = ["generate", str(path), "--prompt", "hello hello hello hello hello", "--json", "--max-tokens", "3",
            "--block-size", "4", "--max-model-len", "256", "--prefix-cache-retention-interval", interval]
    try:
        rc = main(args)
    except SystemExit as exc:  # argparse's own exit
        rc = exc.code
    captured = capsys.readouterr()
    assert rc == code, captured.err
    if code:
        assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    else:
        records = [json.loads(line) for line in captured.out.splitlines()]
        assert [r["output_ids"] for r in records] == [_want(model, r["prompt_ids"])[:3] for r in records]
