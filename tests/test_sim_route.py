"""benchmarks/sim_route.py: the routing simulation is deterministic per seed, accounts for
every request, leaves every replica's pool whole, and its router pieces behave as the real
ones (the hybrid index's predictions hold, full-only's overshoot when windows are evicted)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

import sim_route  # noqa: E402

SMALL = sim_route.SimSetup(conversations=9, turns=3, clients=3, open=2, max_tokens=3)


@pytest.fixture(scope="module")
def small_sweep():
    return sim_route.sweep(SMALL, [192, 768], 2, ["full-only", "hybrid", "oracle", "least-loaded"])


def test_every_request_is_served_once_and_hits_never_exceed_the_prompt(small_sweep):
    for by_policy in small_sweep.values():
        for runs in by_policy.values():
            for run in runs:
                assert len(run.requests) == 27 and sum(run.per_replica) == 27
                assert all(0 <= obtained < prompt for _, _, obtained, prompt in run.requests.values())
                # hits are whole blocks (4 tokens), predicted and obtained alike
                assert all(h % 4 == 0 and o % 4 == 0 for _, h, o, _ in run.requests.values())
                assert 0 <= run.false <= run.predicted and run.obtained < run.prompt
                assert len(run.ttft) == 27 and all(t > 0 for t in run.ttft)


def test_a_seed_gives_the_same_run_and_another_seed_another_timeline(small_sweep):
    again = sim_route.sweep(SMALL, [192], 2, ["hybrid"])
    first = small_sweep[192]["hybrid"]
    assert [r.requests for r in again[192]["hybrid"]] == [r.requests for r in first]
    assert [r.ttft for r in first[0:1]] != [r.ttft for r in first[1:2]]  # the jitter moves the step times


def test_the_index_policies_predict_what_the_replica_gives(small_sweep):
    """Hybrid predicts from KV events, so within transit it is the oracle's prediction; a tight
    pool evicts sliding windows that full-only still counts (its false residency)."""
    tight = small_sweep[192]
    for run in tight["hybrid"] + tight["oracle"]:
        assert run.false <= 0.1 * max(run.predicted, 1)
    assert sum(r.false for r in tight["full-only"]) > sum(r.false for r in tight["hybrid"])
    roomy = small_sweep[768]
    assert min(r.obtained for r in roomy["hybrid"]) > max(r.obtained for r in tight["hybrid"])
    # least-loaded ignores the caches: it moves chats and obtains less, even with room to spare
    assert sum(r.moves for r in roomy["least-loaded"]) > sum(r.moves for r in roomy["hybrid"])
    assert max(r.obtained for r in roomy["least-loaded"]) < min(r.obtained for r in roomy["hybrid"])


def test_no_jitter_and_no_races_make_the_seed_irrelevant():
    calm = dataclasses.replace(SMALL, timing=sim_route.Timing(jitter=0.0, release_ms=0.0))
    runs = sim_route.sweep(calm, [256], 2, ["hybrid"])[256]["hybrid"]
    assert runs[0].requests == runs[1].requests and runs[0].ttft == runs[1].ttft


def test_cli_prints_the_table(capsys):
    assert sim_route.main(["--num-blocks", "256", "--seeds", "1", "--policies", "full-only,hybrid",
                           "--conversations", "6", "--turns", "2", "--clients", "2", "--open", "2"]) == 0
    out = capsys.readouterr().out
    assert "256 blocks per replica" in out and "hybrid - full-only per seed" in out
