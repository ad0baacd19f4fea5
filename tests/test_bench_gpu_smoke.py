"""benchmarks/bench_gpu.py end to end at its smallest: ``--smoke`` runs every section on CPU
with tiny shapes (reference backend) and writes a report with no errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gpu_smoke_runs_every_section(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # reference only: seconds, not minutes
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--smoke", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert set(report["sections"]) == {"a", "b", "c", "d"}
    for name, section in report["sections"].items():
        assert section["error"] is None, f"section {name}: {section['error']}"
        rows = section["rows"]
        assert rows and not [r for r in rows if "error" in r or "skipped" in r], (name, rows)
    parity = report["sections"]["d"]["rows"]
    assert len(parity) == 4 and all(r["equal"] == r["requests"] for r in parity)
    assert "| section | case |" in (tmp_path / "bench_gpu.md").read_text()
