"""vllm-router (vLLM's Rust router, the PyPI wheel) in front of two ``hybridkv serve`` replicas.

``kv_aware`` discovers each replica (``/get_server_info``, ``/kv_event_sources``), subscribes
to its KV events, learns each prompt's tokens from ``/v1/*/render`` and credits a replica the
prefix its index holds. The oracle is the replica itself: the prefix vllm-router credits the
replica it chose (its ``KV prefix decision`` debug line) equals the ``cached_tokens`` that
replica reports, request after request, for completions and chat. ``power_of_two`` reads
``/get_load``: a replica holding three streams shows load 3 and the other 0.
"""

from __future__ import annotations

import re
import shutil
import threading

import pytest

from tests.interop.conftest import Process, cached_tokens, httpx, requests_finished, settle, shared_prefix_workload, wait_http
from tests.support.processes import free_port, wait_until

pytestmark = [pytest.mark.live, pytest.mark.skipif(shutil.which("vllm-router") is None,
                                                   reason="vllm-router is not installed (pip install 'hybridkv[interop]')")]

DECISION = re.compile(r'KV prefix decision outcome="(\w+)" worker="([^"]+)" input_tokens=(\d+) '
                      r'new_prefill_tokens=(\d+) credited_prefix_tokens=(\d+)')
POWER = re.compile(r"Power-of-two selection: (\S+)=(-?\d+) vs (\S+)=(-?\d+) -> selected (\S+)")


def start_router(replicas, policy: str, *extra: str) -> tuple[Process, str]:
    port, metrics_port = free_port(), free_port()
    router = Process(["vllm-router", "--worker-urls", *[r.base_url for r in replicas], "--policy", policy,
                      "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                      "--prometheus-port", str(metrics_port), "--log-level", "debug", *extra])
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", router)
    return router, base


def decisions(router: Process) -> list[tuple]:
    return [m.groups() for m in DECISION.finditer(router.output)]


def test_kv_aware_credits_what_each_replica_reports_cached(replicas):
    router, base = start_router(replicas, "kv_aware")
    try:
        assert wait_until(lambda: router.output.count("spawned subscriber") == 2, 20), router.output[-3000:]
        requests = [("/v1/completions", {"prompt": p, "max_tokens": 2}) for p in shared_prefix_workload(10)]
        chat = [{"role": "system", "content": "You answer briefly. " * 8}, {"role": "user", "content": "Hi there"}]
        requests += [("/v1/chat/completions", {"messages": chat, "max_tokens": 2})] * 2
        credited, cached, served_by = [], [], []
        for path, body in requests:
            before = [requests_finished(r.base_url) for r in replicas]
            got = cached_tokens(httpx.post(base + path, json=body, timeout=60))
            after = [requests_finished(r.base_url) for r in replicas]
            served_by.append([r.base_url for r, a, b in zip(replicas, after, before) if a > b])
            cached.append(got)
            assert wait_until(lambda: len(decisions(router)) == len(cached), 10), router.output[-2000:]
            outcome, worker, inputs, new, credit = decisions(router)[-1]
            assert outcome == "prefix_cost", outcome  # it knew the prompt's tokens (the render routes)
            assert [worker] == served_by[-1]
            assert int(inputs) == int(new) + int(credit)
            credited.append(int(credit))
            settle()  # the index catches up with this request's events before the next
        assert credited == cached, (credited, cached)
        assert sum(cached) > 0 and cached[-1] > 0  # the workload hit, chat included
    finally:
        router.stop()


def test_power_of_two_sees_each_replicas_load(replicas):
    busy, idle = replicas
    # its load poll runs every --worker-startup-check-interval seconds
    router, base = start_router(replicas, "power_of_two", "--worker-startup-check-interval", "1")
    streams = []
    try:
        def hold():  # a long stream straight to the busy replica
            with httpx.stream("POST", busy.base_url + "/v1/completions", timeout=120, json={
                    "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

        stop = threading.Event()
        streams = [threading.Thread(target=hold, daemon=True) for _ in range(3)]
        for t in streams:
            t.start()
        assert wait_until(lambda: httpx.get(busy.base_url + "/get_load").json() == {"load": 3}, 20)

        def polled() -> bool:  # ask until a choice shows a poll made while the streams ran
            httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
            return any(int(m.group(2)) > 0 or int(m.group(4)) > 0 for m in POWER.finditer(router.output))

        assert wait_until(polled, 20, 0.5), router.output[-3000:]
        seen = [m for m in POWER.finditer(router.output) if int(m.group(2)) > 0 or int(m.group(4)) > 0][-1]
        loads = {seen.group(1): int(seen.group(2)), seen.group(3): int(seen.group(4))}
        assert loads == {busy.base_url: 3, idle.base_url: 0}
        assert seen.group(5) == idle.base_url
    finally:
        stop.set()
        for t in streams:
            t.join(30)
        router.stop()
