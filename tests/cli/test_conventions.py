"""CLI conventions: usage, --version, help with defaults, one --max-model-len parser."""

from __future__ import annotations

import argparse
import json

import pytest

from hybridkv import __version__
from hybridkv.cli import COMMANDS, build_parser, main
from hybridkv.scheduler.workloads import TRACE_FORMAT


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_bare_hybridkv_prints_usage_and_commands_and_exits_2(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("usage: hybridkv") and err == ""
    for name in COMMANDS:
        assert f"    {name}" in out


def test_help_exits_0_and_version(capsys):
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: hybridkv")
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"hybridkv {__version__}\n"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_states_its_default(command):
    parser = _subparsers()[command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        assert action.help and "default" in action.help, f"{command} {action.option_strings[0]}: {action.help!r}"


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("text, tokens", [("128k", 128_000), ("128K", 131_072), ("1M", 2**20), ("25.6k", 25_600),
                                          ("4096", 4096)])
def test_max_model_len_parses_the_same_everywhere(command, text, tokens):
    parser = _subparsers()[command]
    if not any("--max-model-len" in a.option_strings for a in parser._actions):
        pytest.skip(f"{command} has no --max-model-len (it runs no engine)")
    args = parser.parse_args(["x", "--max-model-len", text])
    assert args.max_model_len == tokens


def test_simulate_help_documents_the_trace_format(capsys):
    assert main(["simulate", "--help"]) == 0
    out = capsys.readouterr().out
    assert TRACE_FORMAT in out and "prompt_len" in out and "prefix_id" in out


def test_generate_engine_options_reach_engine_config(tiny_llama, monkeypatch, capsys):
    pytest.importorskip("torch")
    import hybridkv.engine.llm as llm_module
    from hybridkv.cli import engine_args
    from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from hybridkv.engine.engine import EngineConfig

    # the defaults --help states are the engine's
    assert EngineConfig().max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig().dtype == engine_args.DTYPES[0]
    seen = []

    class Captured(Exception):
        pass

    def fake_engine(model_dir, config):
        seen.append(config)
        raise Captured

    monkeypatch.setattr(llm_module, "LLMEngine", fake_engine)  # generate runs the text front, LLM
    with pytest.raises(Captured):
        main(["generate", str(tiny_llama), "--prompt-ids", "1,2", "--dtype", "bfloat16", "--max-num-seqs", "3",
              "--max-num-batched-tokens", "7", "--max-model-len", "0.1k", "--num-blocks", "9"])
    with pytest.raises(Captured):
        main(["generate", str(tiny_llama), "--prompt-ids", "1", "--prompt-ids", "2"])
    with pytest.raises(Captured):
        main(["generate", str(tiny_llama), "--prompt-ids", "1", "--no-hybrid"])
    a, b, c = seen
    assert a.hybrid and b.hybrid and not c.hybrid
    assert (a.dtype, a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len, a.num_blocks) == (
        "bfloat16", 3, 7, 100, 9)
    assert (b.dtype, b.max_num_seqs, b.max_num_batched_tokens, b.max_model_len) == ("float32", 2, 2048, None)
    # every flag left out is EngineConfig's own default (generate sizes max_num_seqs to its prompts)
    import dataclasses

    assert dataclasses.replace(b, max_num_seqs=EngineConfig().max_num_seqs) == EngineConfig()


def test_generate_dtype_runs(tiny_llama, capsys):
    assert main(["generate", str(tiny_llama), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--dtype", "bfloat16",
                 "--max-num-batched-tokens", "2", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["output_ids"]) == 2


def test_simulate_json_is_summary_only_unless_series_asked(capsys):
    argv = ["simulate", "mistral-7b", "--memory", "2GiB", "--num-requests", "3", "--no-progress"]
    assert main([*argv, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--json-series"]) == 0
    series = json.loads(capsys.readouterr().out)
    for p, s in zip(plain["results"], series["results"]):
        assert "series" not in p and len(s.pop("series")["kv_usage"]) == s["steps"]
        p.pop("wall_seconds"), s.pop("wall_seconds")
        assert p == s
