"""benchmarks/bench_route.py end to end at its smallest: one tiny replica and a hybrid
router (real processes on 127.0.0.1), a few two-turn chats, the report printed."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")


import bench_route


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


@pytest.mark.slow
def test_bench_route_runs_and_reports(capsys):
    code = bench_route.main(["--policies", "hybrid", "--replicas", "1", "--rounds", "1", "--conversations", "4",
                             "--turns", "2", "--clients", "2", "--open", "2", "--max-tokens", "2", "--no-route-cost"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "hybrid false residency" in out and "failed requests: 0" in out
    row = next(line for line in out.splitlines() if line.startswith("hybrid "))
    assert int(row.split()[1]) == 8  # requests
    assert "where predicted hit tokens went" in out  # every response joined to its replica's debug line


def test_replica_lines_join_their_responses_and_split_the_loss(capsys):
    """The replica's debug line (server/async_llm.py's format) joins the response named
    after it; the loss chain predicted -> held at the decision -> queued -> obtained."""
    def rec(rid, predicted, obtained, resident=None):
        return bench_route.Rec(0, 1, "r0", predicted, obtained, 40, 2, 0.1, 0.0, resident, rid)

    line = ("hybridkv serve: DEBUG request chatcmpl-{}-0 length: 40 prompt tokens; prefix hit {} when queued, {} at "
            "admission, {} at the last admission ({} preemptions); 2 output tokens\n")
    run = bench_route.PolicyRun("hybrid", 0)
    run.recs = [rec("chatcmpl-a", 32, 8, 24),  # 8 not held at the decision, 8 lost in transit, 8 while queued
                rec("chatcmpl-b", 16, 16, 16),  # nothing lost
                rec("chatcmpl-c", 8, 12, 8),    # obtained more than predicted: no loss
                rec("chatcmpl-d", 0, 4)]        # nothing predicted: left out
    bench_route._join_replica_logs(run, [[line.format("a", 16, 8, 8, 1), "noise\n"],
                                         [line.format("b", 16, 16, 16, 0), line.format("c", 12, 12, 12, 0),
                                          line.format("d", 4, 4, 4, 0)]])
    assert [(r.queued, r.last, r.preemptions) for r in run.recs] == [(16, 8, 1), (16, 16, 0), (12, 12, 0), (4, 4, 0)]
    bench_route.decomposition({"hybrid": [run]})
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("hybrid "))
    assert " ".join(row.split()).startswith("hybrid 56 8 ( 14.3%) 8 ( 14.3%) 8 ( 14.3%) 1 of 3 requests lost hits "
                                            "while queued; 1 preempted")
