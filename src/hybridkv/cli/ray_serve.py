"""``hybridkv ray-serve``: replicas of ``serve``'s app on a local Ray cluster, KV-aware routed.

    pip install 'hybridkv[ray]'
    hybridkv ray-serve smollm2-135m --replicas 2 --port 8000 --max-model-len 4096

Starts Ray on this machine (no dashboard, no usage reporting; with ``--host 127.0.0.1``
every Ray process listens on loopback), then Serve's HTTP proxy on ``--host:--port`` in
front of :mod:`hybridkv.integrations.ray_serve`'s deployments. Once it serves, one line
goes to stderr: ``hybridkv ray-serve: listening on http://HOST:PORT (model NAME, N
replicas)``. SIGTERM or Ctrl-C shuts Serve and Ray down (each replica's requests aborted,
its pool checked) and exits 0. Engine flags are ``serve``'s. Bad options or a missing
``[ray]`` extra: one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
import threading

from hybridkv.cli.engine_args import add_engine_options, engine_config, require_engine_dependencies
from hybridkv.cli.model_dir import resolve_model_source
from hybridkv.cli.options import int_range
from hybridkv.cli.route import add_policy_options
from hybridkv.errors import InvalidConfigError
from hybridkv.scheduler.config import ENGINE_MAX_NUM_SEQS

__all__ = ["add_parser", "run"]

PREFIX = "hybridkv ray-serve"
POLICIES = ("hybrid", "full-only", "least-loaded", "round-robin")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("ray-serve", help="serve replicas of a model on Ray Serve, routed by KV cache hits",
                              description="Replicas of `hybridkv serve`'s app as a Ray Serve deployment on a local "
                                          "Ray cluster, routed by hybridkv's KV-aware policy (pip install 'hybridkv[ray]').")
    p.add_argument("model", metavar="MODEL", help="gemma-3-270m, smollm2-135m, a .gguf file, or a model directory")
    p.add_argument("--replicas", type=int_range(1), default=2, help="engine replicas (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="address of Serve's HTTP proxy (default 127.0.0.1)")
    p.add_argument("--port", type=int_range(0, 65535), default=8000, help="its port; 0 picks a free one (default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME", help="the model's name in the API (default MODEL)")
    add_policy_options(p, list(POLICIES))
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health and /metrics, as serve (default: none)")
    add_engine_options(p, max_num_seqs_default=str(ENGINE_MAX_NUM_SEQS))
    p.set_defaults(func=run)
    return p


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    # before Ray is imported: it reads them into constants at import
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token written under ~/.ray for a local cluster
    loopback = args.host in ("127.0.0.1", "localhost")
    if loopback:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's node address: 127.0.0.1
    try:
        import ray
        from ray import serve
    except ImportError:
        raise InvalidConfigError("ray-serve needs Ray Serve, which is not installed: pip install 'hybridkv[ray]'") from None
    require_engine_dependencies("ray-serve")
    source = resolve_model_source(args.model)
    engine = dataclasses.asdict(dataclasses.replace(engine_config(args, ENGINE_MAX_NUM_SEQS), queued_prefix="refresh"))
    name = args.served_model_name or args.model
    server = {"model_name": name, **({"api_key": args.api_key} if args.api_key else {})}
    port = args.port or _free_port(args.host)

    from hybridkv.integrations.ray_serve import build_ray_app

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
             **({"_node_ip_address": "127.0.0.1"} if loopback else {}))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": port})
        serve.run(build_ray_app(str(source.path), num_replicas=args.replicas, engine=engine, server=server,
                                policy=args.policy, max_imbalance=args.max_imbalance,
                                max_share_ratio=args.max_share_ratio or None, share_window=args.share_window),
                  name="hybridkv", route_prefix="/")
        print(f"{PREFIX}: listening on http://{args.host}:{port} (model {name}, {args.replicas} replicas)",
              file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{PREFIX}: stopped", file=sys.stderr, flush=True)
    return 0
