"""Run a scheduler to completion over a fake runner, recording its schedule (the scheduler tests)."""

from __future__ import annotations

from hybridkv.scheduler import FakeRunner

__all__ = ["run"]


def run(sched, runner=None):
    """Run to completion; the schedule as [(step, [(id, tokens, computed)], preempted, finished)]."""
    runner = runner or FakeRunner()
    trace, done = [], {}
    while sched.has_unfinished_requests():
        out, fin = sched.step(runner)
        sched.check_invariants()
        trace.append(
            (out.step, [(r.request_id, len(r.token_ids), r.num_computed_tokens) for r in out.scheduled],
             out.preempted_request_ids, [f.request_id for f in fin])
        )
        done.update({f.request_id: f for f in fin})
        assert out.step < 500, "did not finish"
    return trace, done
