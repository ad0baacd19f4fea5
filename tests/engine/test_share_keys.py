"""Share keys through the engine (:mod:`hybridkv.scheduler.shares`): requests preempted to make
room for a newcomer's key, recomputed later, produce the same greedy tokens as the same
prompts run without keys, and every block is free at the end (the tiny model)."""

from __future__ import annotations

from hybridkv.sampling_params import SamplingParams


def test_keyed_requests_preempted_for_newcomers_keep_their_greedy_tokens(tiny_llm):
    engine = tiny_llm.engine
    sp = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    prompts = {f"a{i}": [3 + i, 5, 7, 11 + i % 5, 13, 17 + i] for i in range(20)}
    late = {"b0": [19, 23, 29, 31], "c0": [37, 41, 43, 47, 53]}
    before = engine.scheduler.num_share_preemptions
    for rid, ids in prompts.items():
        engine.add_request(ids, sp, request_id=rid, share_key="a")
    got: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step in (2, 5):
            rid = "b0" if step == 2 else "c0"
            engine.add_request(late[rid], sp, request_id=rid, share_key=rid[0])
        for d in engine.step_deltas():
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
        engine.scheduler.check_invariants()
        step += 1
    assert engine.scheduler.num_share_preemptions - before >= 2  # one slot made for each newcomer
    everything = {**prompts, **late}
    expected = tiny_llm.generate([[*ids] for ids in everything.values()], sp)
    for (rid, _), out in zip(everything.items(), expected):
        assert got[rid] == list(out.token_ids), rid
    usage = engine.kv.pool_usage()
    assert usage.free == usage.usable
