import json
import subprocess
import sys

import pytest
from tests.support.tiers import scaled

from hybridkv.cli import main


def test_simulate_table(capsys):
    assert main(["simulate", "llama4-scout", "--memory", "8GiB", "--workload", "long-doc", "--num-requests", "8",
                 "--max-model-len", "64K", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "steps to finish" in out and "hybrid" in out and "full / hybrid steps" in out


def test_simulate_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    assert main(["simulate", "gemma-3-27b", "--memory", "4GiB", "--workload", "chat", "--num-requests", "6",
                 "--json-series", "--plot", str(png), "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["layout"] for r in data["results"]] == ["hybrid", "full"]
    assert all(r["finished"] == 6 for r in data["results"])
    for r in data["results"]:  # the time series behind the plot
        assert len(r["series"]["kv_usage"]) == len(r["series"]["running"]) == r["steps"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_trace_file(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt": [1, 2, 3], "output_len": 3}\n{"arrival": 2, "prompt_len": 40, "output_len": 2}\n')
    assert main(["simulate", "mistral-7b", "--memory", "1GiB", "--workload", str(trace), "--json", "--no-progress"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert results[0]["finished"] == 2 and "series" not in results[0]  # --json: the summary only


def test_bad_trace_line_is_one_line_error_exit_2(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt": [1], "output_len": 1}\n{"prompt": [1], "output_len": "many"}\n')
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "simulate", "mistral-7b", "--workload", str(trace)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and f"{trace}:2:" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_workload(capsys):
    assert main(["simulate", "mistral-7b", "--workload", "bursty"]) == 2
    assert "unknown workload 'bursty'" in capsys.readouterr().err


def test_readme_long_doc_figures_under_both_admission_policies(capsys):
    """README's simulate block: the same seeded requests under vLLM's default gate and without it."""
    import json

    from hybridkv.cli import main

    want = {"full_prompt": [(473, 2, 43), (927, 2, 15)], "first_chunk": [(473, 2, 43), (919, 32, 15)]}
    policies = scaled(("full_prompt", "first_chunk"), ("first_chunk",))  # the fast tier: the one whose figures move
    figures = {}
    for policy in policies:
        assert main(["simulate", "llama4-scout", "--memory", "80GiB", "--workload", "long-doc",
                     "--admission", policy, "--json"]) == 0
        results = json.loads(capsys.readouterr().out)["results"]
        assert [r["admission"] for r in results] == [policy, policy]
        figures[policy] = [(r["steps"], r["preemptions"], r["peak_running"]) for r in results]
    assert figures == {p: want[p] for p in policies}


def test_simulate_a_state_model(capsys):
    """Qwen3-Next (1 full + 3 Gated DeltaNet state groups, block 544): both layouts run the
    chat workload to the end with prefix hits (state checkpoints restored); the all-full
    layout keeps the states, so its figures equal the hybrid's."""
    assert main(["simulate", "qwen3-next-80b-a3b", "--memory", "8GiB", "--workload", "chat", "--num-requests", "24",
                 "--json", "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    hybrid, full = data["results"]
    assert hybrid["finished"] == full["finished"] == 24 and hybrid["rejected"] == 0
    assert hybrid["prefix_hit_rate"] > 0.3
    for key in ("num_blocks", "steps", "generated_tokens", "prefix_hit_rate"):
        assert hybrid[key] == full[key]
