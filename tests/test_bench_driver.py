"""The benchmark driver (benchmarks/_traces.py): its scheduler-like lane mode ("sched")
must make the same manager decisions as the plain mode, hash each arriving prompt
once, and read block ids where vLLM's scheduler does."""

from __future__ import annotations

import pytest

from _traces import Driver, HybridLane, make_fuzz_trace


class CountingLane(HybridLane):
    """hybridkv in sched mode, counting what the driver asks of it."""

    def __init__(self):
        super().__init__(sched=True)
        self.hashed: list[str] = []
        self.new_id_reads = 0
        self.table_reads: list[str] = []

    def build(self, tr):
        super().build(tr)
        hash_request, new_ids, table_ids = self.hash_request, self.new_ids, self.table_ids

        def hashing(req):
            assert not req.block_hashes, f"{req.request_id} hashed twice"
            self.hashed.append(req.request_id)
            hash_request(req)

        def reading_new(blocks):
            self.new_id_reads += 1
            return new_ids(blocks)

        def reading_table(rid):
            ids = table_ids(rid)
            assert [list(g) for g in ids] == self.block_ids(rid)
            self.table_reads.append(rid)
            return ids

        self.hash_request, self.new_ids, self.table_ids = hashing, reading_new, reading_table


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 5, 8, 13, 21, 34, 55])
def test_sched_mode_same_decisions_as_plain(seed):
    tr = make_fuzz_trace(seed)
    plain = Driver(tr, HybridLane()).run()
    lane = CountingLane()
    sched = Driver(tr, lane).run()
    lane.kv.check_invariants()
    same = ("steps", "lookups", "hit_tokens", "preemptions", "admitted", "finished", "alloc_fail_admit")
    assert {k: getattr(sched, k) for k in same} == {k: getattr(plain, k) for k in same}
    # every admission read the whole table once; each request object hashed once (CountingLane
    # asserts it), so a request id is hashed again only when a preempted request is rebuilt
    assert len(lane.table_reads) == sched.admitted
    assert len(set(lane.hashed)) <= len(lane.hashed) <= len(set(lane.hashed)) + sched.preemptions
    assert set(lane.hashed) >= set(lane.table_reads)
    assert lane.new_id_reads + sched.admitted == sched.req_steps  # no warm-up in fuzz traces


def test_sched_mode_counts_on_a_known_trace():
    """Seed 0's trace, played without warm-up: scheduled (request, step) pairs = new-id reads
    of running requests + admissions."""
    tr = make_fuzz_trace(0)
    tr.warmup_steps = 0
    lane = CountingLane()
    res = Driver(tr, lane).run()
    assert res.admitted > 0
    assert lane.new_id_reads + res.admitted == res.req_steps
    assert res.hash_ns > 0
