"""The router's proxy in-process, over fake replicas (httpx.MockTransport): pass-through,
retries on refused connections, clean 502/503s, and the policies' one pick rule."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from hybridkv.errors import InvalidConfigError  # noqa: E402
from hybridkv.router.policy import make_policy, pick  # noqa: E402
from hybridkv.router.replica import Replica, ReplicaSpec  # noqa: E402
from hybridkv.router.router import Router, RouterConfig  # noqa: E402
from tests.support.fake_replicas import SSE, FakeReplicas, run_router as _run  # noqa: E402

def test_requests_pass_through_with_the_routing_headers():
    fake = FakeReplicas(3)

    async def body(client, router):
        plain = [await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) for _ in range(3)]
        bad = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
        stream = await client.post("/v1/chat/completions", json={"messages": [], "stream": True})
        models = await client.get("/v1/models")
        return plain, bad, stream, models

    plain, bad, stream, models = _run(fake, body, "round-robin")
    assert [r.headers["x-hybridkv-replica"] for r in plain] == ["r0", "r1", "r2"]
    assert [r.json()["choices"][0]["text"] for r in plain] == ["r0", "r1", "r2"]
    assert all(r.headers["x-hybridkv-predicted-hit"] == "0" for r in plain)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # the replica's own answer
    assert stream.status_code == 200 and stream.content == SSE
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert models.json()["data"][0]["id"] == "m"
    assert [path for _, path, _ in fake.seen] == ["/v1/completions"] * 4 + ["/v1/chat/completions"]


def test_a_refused_connection_marks_the_replica_down_and_goes_elsewhere():
    fake = FakeReplicas(3)

    async def body(client, router):
        fake.dead.add("r0")
        first = await client.post("/v1/completions", json={"prompt": "x"})
        up = [r.up for r in router.replicas]
        fake.dead.update({"r1", "r2"})
        none = await client.post("/v1/completions", json={"prompt": "x"})
        health = await client.get("/health")
        failures = [r.num_failures for r in router.replicas]
        fake.dead.clear()
        await router.probe_all()
        back = await client.post("/v1/completions", json={"prompt": "x"})
        fake.dead.add("r1")
        await router.probe_all()  # a death the health probe finds counts too
        await router.probe_all()  # ... once
        described = (await client.get("/router/replicas")).json()["replicas"]
        return first, up, none, health, back, failures, described

    first, up, none, health, back, failures, described = _run(fake, body)
    assert failures == [1, 1, 1]  # each went down once
    assert [r["failures"] for r in described] == [1, 2, 1] and not described[1]["up"]
    assert first.status_code == 200 and first.headers["x-hybridkv-replica"] in ("r1", "r2")
    assert up == [False, True, True]
    assert none.status_code == 503 and none.headers["retry-after"] == "1"
    assert none.json()["error"]["type"] == "server_overloaded"
    assert health.status_code == 503
    assert back.status_code == 200


def test_a_replica_failing_mid_stream_ends_the_stream_with_an_error():
    fake = FakeReplicas(1)
    fake.broken.add("r0")

    async def body(client, router):
        r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        return r, router.replicas[0].in_flight

    r, in_flight = _run(fake, body)
    assert r.status_code == 200
    events = [b for b in r.text.split("\n\n") if b.strip()]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][len("data: "):])
    assert err["error"]["code"] is None and err["error"]["type"] == "server_error"
    assert in_flight == 0


def test_bad_bodies_are_400_and_unknown_routes_404():
    fake = FakeReplicas(1)

    async def body(client, router):
        return (await client.post("/v1/completions", content=b"{nope"),
                await client.get("/v1/nothing"),
                await client.get("/router/replicas"))

    bad, missing, replicas = _run(fake, body)
    assert bad.status_code == 400 and bad.json() == {"error": {
        "message": "malformed JSON body", "type": "invalid_request_error", "param": None, "code": None}}
    assert missing.status_code == 404 and "error" in missing.json()
    assert replicas.json()["replicas"][0]["url"] == "http://r0:8000"
    assert not fake.seen


def test_a_body_nested_too_deeply_is_a_400():
    """50,000 levels of JSON: the parser's RecursionError is a 400 in OpenAI's shape, not a 500."""
    fake = FakeReplicas(1)

    async def body(client, router):
        deep = b"[" * 50_000 + b"]" * 50_000
        return (await client.post("/v1/completions", content=b'{"prompt": ' + deep + b"}"),
                await client.post("/v1/chat/completions", content=deep))

    for r in _run(fake, body):
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": "malformed JSON body: nested too deeply",
                                     "type": "invalid_request_error", "param": None, "code": None}
    assert not fake.seen


def test_only_admitted_requests_expect_kv_events():
    """A 4xx from a replica admitted nothing: the router must not wait for its blocks' events
    (waiting dropped a healthy replica's index on the timeout)."""
    fake = FakeReplicas(1)
    served = []

    async def body(client, router):
        router.served = lambda replica, *args: served.append(replica.name)
        refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
        after_refusal = list(served)
        ok = await client.post("/v1/completions", json={"prompt": "x"})
        return refused, after_refusal, ok, router.replicas[0].in_flight

    refused, after_refusal, ok, in_flight = _run(fake, body)
    assert refused.status_code == 400 and ok.status_code == 200
    assert after_refusal == [] and served == ["r0"] and in_flight == 0


def test_replica_specs_are_checked():
    from hybridkv.errors import InvalidConfigError

    assert ReplicaSpec.parse("http://h:1,tcp://h:2,tcp://h:3") == ReplicaSpec("http://h:1", "tcp://h:2", "tcp://h:3")
    for bad in ("", "h:1", "ftp://h", "http://h:1,,", "http://h:1,udp://x", "http://h,tcp://a,tcp://b,tcp://c"):
        with pytest.raises(InvalidConfigError):
            ReplicaSpec.parse(bad)
    with pytest.raises(InvalidConfigError):
        Router([ReplicaSpec("http://h:1"), ReplicaSpec("http://h:1")])
    with pytest.raises(InvalidConfigError):
        RouterConfig(policy="random")


@pytest.mark.parametrize("seed", range(40))
def test_pick_takes_the_largest_hit_within_the_imbalance(seed):
    rng = random.Random(seed)
    replicas = [Replica(f"r{i}", ReplicaSpec(f"http://r{i}:1")) for i in range(rng.randint(1, 6))]
    for r in replicas:
        r.in_flight = rng.randint(0, 12)
    hits = [rng.choice([0, 0, 16, 32, 64]) for _ in replicas]
    affinity = [h + rng.choice([0, 0, 8, 40]) for h in hits] if seed % 2 else None  # hybrid: the full-only hit
    imbalance = rng.randint(0, 5)
    asked = []
    chosen, hit = pick(replicas, hits, imbalance, rng.randint(0, 9),
                       (lambda i: asked.append(i) or affinity[i]) if affinity else None)
    least = min(r.in_flight for r in replicas)
    top = max(h for h, r in zip(hits, replicas) if r.in_flight <= least + imbalance)
    tied = {i for i, (h, r) in enumerate(zip(hits, replicas)) if h == top and r.in_flight <= least + imbalance}
    assert sorted(asked) == (sorted(tied) if affinity and len(tied) > 1 else [])  # only ties are asked, once each
    key = list(zip(hits, affinity or [0] * len(hits)))
    eligible = [(k, r) for k, r in zip(key, replicas) if r.in_flight <= least + imbalance]
    assert chosen.in_flight <= least + imbalance
    best = max(k for k, _ in eligible)
    assert hit == hits[replicas.index(chosen)] == best[0] and key[replicas.index(chosen)] == best
    assert chosen.in_flight == min(r.in_flight for k, r in eligible if k == best)


def test_least_loaded_and_round_robin_spread_requests():
    replicas = [Replica(f"r{i}", ReplicaSpec(f"http://r{i}:1")) for i in range(3)]

    async def main():
        ll, rr = make_policy("least-loaded"), make_policy("round-robin")
        seen_ll, seen_rr = [], []
        for _ in range(6):
            r, _ = await ll.choose([1, 2, 3], replicas)
            r.in_flight += 1
            seen_ll.append(r.name)
            seen_rr.append((await rr.choose(None, replicas))[0].name)
        return seen_ll, seen_rr

    seen_ll, seen_rr = asyncio.run(main())
    assert sorted(seen_ll) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    assert seen_rr == ["r0", "r1", "r2"] * 2


def test_shadow_peek_reports_what_the_replica_held_at_the_decision():
    fake = FakeReplicas(2)
    real = fake.__call__

    def with_peek(request):
        if request.url.path == "/kv_cache/peek":
            return httpx.Response(200, json={"prompt_tokens": 3, "cached_tokens": 7})
        return real(request)

    async def body(c, router):
        return (await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}),
                await c.post("/v1/completions", json={"prompt": "text, no tokenizer", "max_tokens": 1}))

    ids, text = _run(with_peek, body, n=2, config=RouterConfig(policy="hybrid", health_interval=60, shadow_peek=True))
    assert ids.headers["x-hybridkv-resident-hit"] == "7" and ids.headers["x-hybridkv-predicted-hit"] == "0"
    assert "x-hybridkv-resident-hit" not in text.headers  # no token ids: nothing to ask


def test_a_client_that_leaves_before_the_replica_answers_is_not_counted_in_flight():
    """The request is cancelled while the router waits for the replica's response head:
    the replica's in-flight count goes back down (else least-loaded would shun it)."""
    entered = asyncio.Event()

    async def hanging(request):
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        entered.set()
        await asyncio.sleep(3600)

    async def body(c, router):
        task = asyncio.create_task(c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}))
        await asyncio.wait_for(entered.wait(), 10)
        during = router.replicas[0].in_flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return during, router.replicas[0].in_flight

    assert _run(hanging, body, n=1) == (1, 0)


def test_hybrid_breaks_hit_ties_towards_the_replica_holding_the_chain():
    """A conversation's full-attention chain is still on r0 but the sliding-window blocks
    its hit needs were evicted: the hit is 0 on both replicas. The hybrid policy keeps
    it on r0 (the longest full-attention residency breaks the tie before load), where
    its next turn will hit; least-loaded alone would move it to r1."""
    from hybridkv.router.index import Prompt
    from hybridkv.protocol.kv_events import BlockStored

    tokens = list(range(1, 22))  # 5 blocks of 4 and one token

    def stored(gid, kind, span, first, n, parent, seq):
        return BlockStored(block_hashes=[f"{seq}{i}".encode() for i in range(first, first + n)], parent_block_hash=parent,
                           token_ids=seq[first * 4:(first + n) * 4], block_size=4, lora_id=None, medium="GPU",
                           lora_name=None, group_idx=gid, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=span)

    replicas = [Replica(f"r{i}", ReplicaSpec(f"http://r{i}:1")) for i in range(2)]
    other = list(range(100, 121))
    replicas[0].on_events([stored(0, "full_attention", None, 0, 5, None, tokens),  # its window blocks: evicted
                           stored(1, "sliding_window", 8, 0, 5, None, other)])
    replicas[1].on_events([stored(0, "full_attention", None, 0, 5, None, other),
                           stored(1, "sliding_window", 8, 0, 5, None, other)])
    replicas[0].in_flight = 1
    prompt = Prompt(tokens)
    assert [r.score(prompt) for r in replicas] == [0, 0]
    assert [r.score_full_only(prompt) for r in replicas] == [20, 0]

    async def main():
        hybrid = make_policy("hybrid", max_imbalance=2)
        return (await hybrid.choose(prompt, replicas), await make_policy("least-loaded").choose(prompt, replicas))

    (chosen, hit), (loaded, _) = asyncio.run(main())
    assert (chosen.name, hit, loaded.name) == ("r0", 0, "r1")


class _SlowTokenizer:
    """Characters as ids; a text holding ``slow`` takes 1.5 s (a huge prompt's tokenization)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.lengths: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.lengths.append(len(text))
        if "slow" in text:
            self.started.set()
            time.sleep(1.5)
        return [ord(c) % 128 for c in text]


def test_bodies_over_the_limit_are_413_at_the_router():
    fake = FakeReplicas(2)
    big = json.dumps({"prompt": "a" * 5000, "max_tokens": 2}).encode()

    async def chunks():
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    async def body(client, router):
        declared = await client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        chunked = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        small = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        return declared, chunked, small, [r.up for r in router.replicas]

    declared, chunked, small, up = _run(fake, body, config=RouterConfig(policy="least-loaded", health_interval=60,
                                                                        max_request_bytes=4096))
    for r in (declared, chunked):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert small.status_code == 200 and up == [True, True]
    assert len(fake.seen) == 1  # the refused bodies never reached a replica
    with pytest.raises(InvalidConfigError, match="max_request_bytes"):
        RouterConfig(max_request_bytes=0)


def test_the_router_tokenizes_off_the_event_loop_and_skips_huge_prompts():
    from hybridkv.router.router import MAX_ROUTED_CHARS

    fake = FakeReplicas(2)
    tok = _SlowTokenizer()

    async def body(client, router):
        job = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "slow one", "max_tokens": 2}))
        while not tok.started.is_set():
            await asyncio.sleep(0.01)
        waits = []
        while not job.done():
            t0 = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            waits.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)
        huge = await client.post("/v1/completions", json={"prompt": "b" * (MAX_ROUTED_CHARS + 1), "max_tokens": 2})
        return await job, waits, huge

    config = RouterConfig(policy="hybrid", health_interval=60, max_request_bytes=8 * MAX_ROUTED_CHARS)
    slow, waits, huge = _run(fake, body, config=config, tokenizer=tok)
    assert slow.status_code == 200 and huge.status_code == 200
    assert len(waits) >= 5 and max(waits) < 0.5, waits
    assert huge.headers["x-hybridkv-predicted-hit"] == "0"
    assert max(tok.lengths) <= MAX_ROUTED_CHARS  # the huge prompt went by load, untokenized
