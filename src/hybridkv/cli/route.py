"""``hybridkv route``: a KV-cache-aware router in front of OpenAI-compatible replicas.

    hybridkv serve MODEL --port 8001 --kv-events tcp://127.0.0.1:5557 --kv-events-replay tcp://127.0.0.1:5558 &
    hybridkv serve MODEL --port 8002 --kv-events tcp://127.0.0.1:5567 --kv-events-replay tcp://127.0.0.1:5568 &
    hybridkv route --model MODEL --port 8000 \\
        --replica http://127.0.0.1:8001,tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 \\
        --replica http://127.0.0.1:8002,tcp://127.0.0.1:5567,tcp://127.0.0.1:5568

``--model`` gives the tokenizer (the replicas' model: a name, a .gguf file or a model
directory; nothing is loaded but the tokenizer), so the router sees the token ids the
replicas will. Replicas on other hosts are the same command with their addresses. Once it
listens, one line on stderr: ``hybridkv route: listening on http://HOST:PORT (N replicas,
policy P)``. SIGTERM (or Ctrl-C): new requests and ``/health`` get 503, connections whose
request is still arriving are closed, requests in flight get ``--shutdown-timeout`` seconds
(30) to finish, then the rest end (a stream with an error event) and it exits 0. Bad
options, a bad replica address, a port in use: one line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hybridkv.cli.http_server import add_connection_limits, add_max_request_bytes, add_shutdown_timeout
from hybridkv.cli.options import finite_float, int_range
from hybridkv.errors import InvalidConfigError

__all__ = ["add_parser", "run"]

PREFIX = "hybridkv route"


def add_policy_options(p: argparse.ArgumentParser, policies: list[str]) -> None:
    """``--policy`` (one of ``policies``), ``--max-imbalance``, ``--max-share-ratio``, ``--share-window``:
    how a replica is picked, for ``route`` and ``ray-serve`` alike."""
    from hybridkv.router.balance import DEFAULT_MAX_SHARE_RATIO, DEFAULT_SHARE_WINDOW
    from hybridkv.router.policy import DEFAULT_MAX_IMBALANCE, PolicyName

    p.add_argument("--policy", choices=policies, default=PolicyName.HYBRID.value,
                   help="how to pick a replica (default hybrid)")
    p.add_argument("--max-imbalance", type=int_range(0), default=DEFAULT_MAX_IMBALANCE,
                   help="a hit may send at most this many more in-flight requests to a replica than to the least "
                        f"loaded (default {DEFAULT_MAX_IMBALANCE})")
    p.add_argument("--max-share-ratio", type=finite_float(0.0), default=DEFAULT_MAX_SHARE_RATIO,
                   help="balance: a replica whose share of the last --share-window decisions exceeds this multiple of "
                        f"the least-served replica's is passed over for hits; 0: no such rule (default "
                        f"{DEFAULT_MAX_SHARE_RATIO:g})")
    p.add_argument("--share-window", type=int_range(1), default=DEFAULT_SHARE_WINDOW,
                   help=f"about how many recent decisions the shares count (default {DEFAULT_SHARE_WINDOW})")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from hybridkv.router.policy import PolicyName

    p = subparsers.add_parser("route", help="route OpenAI requests across replicas by their KV cache",
                              description="A KV-cache-aware OpenAI-compatible proxy over hybridkv serve (or "
                                          "vLLM-event-publishing) replicas.")
    p.add_argument("--replica", action="append", default=[], metavar="URL[,EVENTS[,REPLAY]]",
                   help="a replica's base URL, its KV events endpoint and replay endpoint; repeatable (default: none; "
                        "at least one is needed)")
    p.add_argument("--model", default=None, metavar="MODEL",
                   help="the replicas' model, for its tokenizer (default: none: hits are not predicted for text)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int_range(0, 65535), default=8000, help="port; 0 picks a free one (default 8000)")
    add_policy_options(p, [x.value for x in PolicyName])
    p.add_argument("--health-interval", type=finite_float(0.0, low_open=True), default=1.0,
                   help="seconds between replica health probes (default 1)")
    p.add_argument("--events-timeout", type=finite_float(0.0, low_open=True), default=5.0,
                   help="seconds a replica's events may lag a response before its index is dropped (default 5)")
    add_max_request_bytes(p)
    add_connection_limits(p)
    add_shutdown_timeout(p, "requests (streams through the router)")
    p.add_argument("--shadow-peek", action="store_true",
                   help="benchmarks: ask the chosen replica's manager at each decision too, reported in "
                        "x-hybridkv-resident-hit (default off)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning",
                   help="router log level (default warning)")
    p.set_defaults(func=run)
    return p


def _tokenizer(model: str | None):
    if model is None:
        return None
    from hybridkv.cli.model_dir import resolve_model_source
    from hybridkv.planner.architectures import language_model_config
    from hybridkv.planner.presets import load_model_config
    from hybridkv.tokenizer.prompts import checkpoint_tokenizer

    source = resolve_model_source(model)
    loaded = load_model_config(source.path)
    vocab = language_model_config(loaded.config, label=loaded.label)["vocab_size"]
    return checkpoint_tokenizer(source, vocab)


def run(args: argparse.Namespace) -> int:
    from hybridkv.cli.http_server import bind_socket, http_protocol, require_server_dependencies, uvicorn_server
    from hybridkv.router.replica import ReplicaSpec

    if not args.replica:
        raise InvalidConfigError("give at least one --replica URL[,EVENTS[,REPLAY]]")
    specs = [ReplicaSpec.parse(text) for text in args.replica]
    require_server_dependencies(any(s.events for s in specs), command="route", extra=("httpx",))
    from hybridkv.router.router import Router, RouterConfig

    config = RouterConfig(policy=args.policy, max_imbalance=args.max_imbalance,
                          max_share_ratio=args.max_share_ratio or None, share_window=args.share_window,
                          health_interval=args.health_interval,
                          events_timeout=args.events_timeout, shadow_peek=args.shadow_peek,
                          max_request_bytes=args.max_request_bytes)
    tokenizer = _tokenizer(args.model)
    router = Router(specs, config, tokenizer)
    sock = bind_socket(args.host, args.port)
    try:
        import uvicorn

        from hybridkv.router.app import create_router_app, drain, stop_soon

        logging.basicConfig(level=args.log_level.upper(), format=f"{PREFIX}: %(levelname)s %(message)s")
        app = create_router_app(router)
        host, port = sock.getsockname()[:2]
        ready = f"{PREFIX}: listening on http://{host}:{port} ({len(specs)} replicas, policy {config.policy})"
        uv_config = uvicorn.Config(app, log_level=args.log_level, access_log=False, http=http_protocol(args))
        server = uvicorn_server(uv_config, ready, lambda: drain(app), lambda: stop_soon(app), args.shutdown_timeout)
        server.run(sockets=[sock])
    finally:
        sock.close()
    print(f"{PREFIX}: stopped", file=sys.stderr, flush=True)
    return 0
