"""``hybridkv ray-serve``: two replicas on a local Ray cluster behind Ray's HTTP proxy.

The openai SDK talks to it as to ``serve``; a prompt repeated with another tail goes to the
replica that served it first (the ingress renders it, the KV-aware request router scores each
replica's index of its KV events) and hits there; a streaming client that disconnects has its
request aborted on the replica (the replica's routing stats count an ``abort`` and nothing
left unfinished). Everything on 127.0.0.1; bounded in time.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.interop.conftest import MODEL, cached_tokens, httpx, settle, shared_prefix_workload
from tests.support.processes import HybridkvProcess, wait_until

pytestmark = [pytest.mark.live, pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                                   reason="Ray Serve is not installed (pip install 'hybridkv[ray]')")]


@pytest.fixture(scope="module")
def ray_serve():
    # no share rule: in a handful of requests it would pass the replica holding a prefix over (route's tests
    # cover it); here every repeat must follow its hit
    proc = HybridkvProcess([MODEL, "--replicas", "2", "--port", "0", "--max-model-len", "1024", "--num-blocks", "256",
                            "--max-share-ratio", "0"],
                           command="ray-serve", ready_timeout=240, stop_timeout=90)
    yield proc
    assert proc.stop() == 0, proc.stderr[-3000:]


def replicas(base: str) -> list[dict]:
    return httpx.get(base + "/hybridkv/replicas", timeout=10).json()["replicas"]


def test_openai_sdk_through_rays_proxy(ray_serve):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=ray_serve.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert client.models.retrieve(MODEL).id == MODEL
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert "max_tokens" in str(bad.value)


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(ray_serve):
    base = ray_serve.base_url
    for first, again in zip(shared_prefix_workload(2), shared_prefix_workload(4)[2:]):
        a = httpx.post(base + "/v1/completions", json={"prompt": first, "max_tokens": 2}, timeout=60)
        settle(1.0)
        b = httpx.post(base + "/v1/completions", json={"prompt": again, "max_tokens": 2}, timeout=60)
        where = (a.headers["x-hybridkv-replica"], b.headers["x-hybridkv-replica"], replicas(base))
        assert cached_tokens(a) == 0 and cached_tokens(b) >= 48, where  # the system prompt's whole blocks
        assert where[0] == where[1], where
    view = replicas(base)
    assert len(view) == 2 and all(r["kv_events"] for r in view) and sum(r["index_blocks"] for r in view) > 0


def replica_metrics(base: str, replica_id: str) -> dict[str, float]:
    """``replica_id``'s own ``/metrics`` (asked through the ingress, which forwards to the least loaded
    replica: until that one answers; {} if it never does in 40 tries)."""
    for _ in range(40):
        r = httpx.get(base + "/metrics", timeout=10)
        if r.headers["x-hybridkv-replica"] == replica_id:
            return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
                    if line.startswith("vllm:")}
    return {}


def test_a_dropped_client_aborts_the_replicas_request(ray_serve):
    base = ray_serve.base_url
    aborts = 'vllm:request_success_total{finished_reason="abort",model_name="smollm2-135m"}'
    running = 'vllm:num_requests_running{model_name="smollm2-135m"}'
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            "prompt": "Write a very long story:", "max_tokens": 600, "ignore_eos": True, "stream": True}) as r:
        replica = r.headers["x-hybridkv-replica"]
        lines = r.iter_lines()
        assert [next(lines) for _ in range(6)]  # tokens are flowing; then the client goes away
    # the module's only aborted request (the other tests' requests all finish)
    assert wait_until(lambda: (m := replica_metrics(base, replica)).get(aborts) == 1 and m.get(running) == 0, 30, 0.5)
