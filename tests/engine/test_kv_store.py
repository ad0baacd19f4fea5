"""``kv_store`` (``--kv-store all|tail``): which K/V sliding-window and chunked-local layers store.

"tail" sets the specs' ``tail_only``: a prefill chunk's blocks that no later token reads are
never allocated (the core: tests/core/test_block_bound.py, the TailOnly machines), the step
attends to those keys from its own K/V (reference: tests/engine/test_differential.py draws
"tail" in half its cases against transformers; Triton: tests/engine/test_triton_kernels.py),
and the one per-request bound shrinks. Here: the config, the flag, the layout and ``plan``.
"""

from __future__ import annotations

import json

import pytest

from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.models import load_model
from hybridkv.errors import InvalidConfigError
from hybridkv.scheduler import SamplingParams


def test_the_config():
    assert EngineConfig().kv_store == "all" and not EngineConfig().tail_only
    assert EngineConfig(kv_store="tail").tail_only
    for bad in ("none", "", None, True):
        with pytest.raises(InvalidConfigError, match="kv_store must be one of"):
            EngineConfig(kv_store=bad)


def test_the_engine_marks_windowed_groups_only(tiny_models):
    model = load_model(tiny_models("gemma3")[0])
    engines = {s: LLMEngine(model, EngineConfig(kv_store=s, block_size=4, num_blocks=200, max_model_len=128,
                                                max_num_batched_tokens=64)) for s in ("all", "tail")}
    specs = {s: [g.spec for g in e.kv_cache_config.groups] for s, e in engines.items()}
    assert [getattr(sp, "tail_only", None) for sp in specs["all"]] == [
        False if sp.kind == "sliding_window" else None for sp in specs["all"]]
    assert [getattr(sp, "tail_only", None) for sp in specs["tail"]] == [
        True if sp.kind == "sliding_window" else None for sp in specs["tail"]]
    # the admission bound follows: window 12, block 4, budget 64 -> 2 * cdiv(12 + 2, 4) = 8 blocks, not 20
    sliding = [sp for sp in specs["tail"] if sp.kind == "sliding_window"][0]
    assert sliding.max_num_blocks(128, 64) == 8
    assert [sp for sp in specs["all"] if sp.kind == "sliding_window"][0].max_num_blocks(128, 64) == 20
    tokens = {}
    for store, engine in engines.items():
        out = engine.generate([list(range(5, 80))], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        tokens[store] = list(out.output_token_ids)
        engine.scheduler.check_invariants()
    assert tokens["all"] == tokens["tail"]


def test_the_cli_and_plan(capsys):
    from hybridkv.cli import main

    assert main(["generate", "--help"]) == 0
    assert "--kv-store {all,tail}" in capsys.readouterr().out
    assert main(["generate", "--kv-store", "some", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--kv-store" in err and "Traceback" not in err
    per_request = {}
    for store in ("all", "tail"):
        assert main(["plan", "gemma-3-27b", "--max-model-len", "8192", "--kv-store", store, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        groups = plan["hybrid"]["groups"]
        sliding = [g for g in groups if g["spec"]["kind"] == "sliding_window"]
        assert sliding and all(g["spec"].get("tail_only", False) == (store == "tail") for g in sliding)
        per_request[store] = plan["hybrid"]["blocks_per_request"]
        assert plan["full"]["blocks_per_request"] == 512  # the all-full layout: no windowed layer
    # Gemma 3 27B: 62 layers, window 1024, block 16, budget 2048: a sliding group 129 + 64 -> 130 blocks
    assert per_request["tail"] < per_request["all"]
    assert main(["plan", "gemma-3-27b", "--kv-store", "tail"]) == 0
    assert "sliding_window (1024, tail)" in capsys.readouterr().out
