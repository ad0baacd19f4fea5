"""benchmarks/bench_route.py end to end at its smallest: one tiny replica and a hybrid
router (real processes on 127.0.0.1), a few two-turn chats, the report printed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_route  # noqa: E402


def test_workload_is_seeded_and_turns_extend_their_chat():
    a = bench_route.make_workload(3, systems=2, conversations=6, turns=3, clients=2, open_=2)
    b = bench_route.make_workload(3, systems=2, conversations=6, turns=3, clients=2, open_=2)
    assert a == b and a.num_requests == 18
    seen: dict[int, list[dict]] = {}
    for sched in a.schedules:
        for k, t, messages in sched:
            if t:
                prev = seen[k]
                assert messages[:len(prev)] == prev and messages[len(prev)]["role"] == "assistant"
            seen[k] = messages


def test_bench_route_runs_and_reports(capsys):
    code = bench_route.main(["--policies", "hybrid", "--replicas", "1", "--rounds", "1", "--conversations", "4",
                             "--turns", "2", "--clients", "2", "--open", "2", "--max-tokens", "2", "--no-route-cost"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "hybrid false residency" in out and "failed requests: 0" in out
    row = next(line for line in out.splitlines() if line.startswith("hybrid "))
    assert int(row.split()[1]) == 8  # requests
