"""``RayReplicas``: the registry the Ray Serve router and ingress share, without Ray. A replica
whose metadata names KV events is subscribed on first sight and its index follows its events;
in-flight counts never go below 0; replicas that left are unsubscribed and forgotten."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")

from hybridkv.core import events as core  # noqa: E402
from hybridkv.integrations.ray_index import RayReplicas  # noqa: E402
from hybridkv.server.kv_events import KVEventPublisher  # noqa: E402


def test_counts_and_forgetting():
    reg = RayReplicas()
    a = reg.get("a", {}, {"unfinished": 2})
    assert reg.get("a") is a and a.events is None  # no KV events advertised: no subscription
    reg.routed("a"), reg.routed("a"), reg.completed("a"), reg.completed("a"), reg.completed("a")
    reg.routed("nobody")  # unknown ids are ignored
    [snap] = reg.snapshot()
    assert (snap["replica_id"], snap["in_flight"], snap["num_requests"], snap["stats"]) == ("a", 0, 2, {"unfinished": 2})
    reg.keep(["b"])
    assert reg.snapshot() == []


def test_a_replicas_events_fill_its_index():
    tokens = tuple(range(1, 9))
    stored = core.BlockStored((b"\x01" * 32, b"\x02" * 32), (1, 2), None, 4, 0, "full_attention", tokens, None)
    with KVEventPublisher("tcp://127.0.0.1:0", group_specs=[], replay_endpoint="tcp://127.0.0.1:0") as pub:
        reg = RayReplicas()
        replica = reg.get("r0", {})  # seen before its metadata arrived: subscribed when it does
        assert replica.events is None
        assert reg.get("r0", {"kv_events": pub.endpoint, "kv_events_replay": pub.replay_endpoint}) is replica
        try:
            deadline = time.monotonic() + 10
            while replica.score(list(tokens) + [99]) != 8 and time.monotonic() < deadline:
                pub.publish([stored])  # again until the subscription (or its replay) delivers one
                time.sleep(0.1)
            assert replica.score(list(tokens) + [99]) == 8
            assert reg.snapshot()[0]["index_blocks"] == 2
        finally:
            reg.close()
        assert replica.events._closed


def test_app_builder_binds_the_deployments_without_a_cluster():
    pytest.importorskip("ray.serve")
    from hybridkv.integrations.ray_serve import app_builder

    app = app_builder({"model": "smollm2-135m", "num_replicas": "3", "engine": '{"max_model_len": 512}',
                       "policy": "full-only"})
    ingress = app._bound_deployment
    [replica] = ingress.init_args
    deployment = replica._bound_deployment if hasattr(replica, "_bound_deployment") else replica
    assert ingress.name == "HybridkvIngress"
    assert deployment.num_replicas == 3 and deployment.init_args[1] == {"max_model_len": 512}
    router = deployment._deployment_config.request_router_config
    assert router.request_router_class == "hybridkv.integrations.ray_router.KVAwareRequestRouter"
    assert router.request_router_kwargs["policy"] == "full-only"
