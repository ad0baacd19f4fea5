"""``hybridkv serve``: the model behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

    hybridkv serve gemma-3-270m                          # http://127.0.0.1:8000/v1
    hybridkv serve MODEL --port 0                        # an ephemeral port, printed when ready
    hybridkv serve MODEL --kv-events tcp://127.0.0.1:5557 --kv-events-replay tcp://127.0.0.1:5558

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``, vLLM's render and router routes (:mod:`hybridkv.server.app`). The app is
:func:`hybridkv.server.build_app`'s, the one any embedder gets; this module parses flags around it. Once it listens, one line goes to stderr:
``hybridkv serve: listening on http://HOST:PORT (model NAME)``. SIGTERM (or Ctrl-C)
stops admission (503 and ``/health`` 503) and closes connections whose request is still
arriving, then ``--shutdown drain`` lets running requests finish for up to
``--shutdown-timeout`` seconds and ends the rest (a stream with an error event, a whole
response with 503), ``--shutdown abort`` ends them at once; the process ends with one
line giving the pool's free blocks (every block free: exit 0).

Bad options, a missing model or server package, a port in use: one line, exit 2, before
or instead of serving.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from hybridkv.cli.engine_args import add_engine_options, check_kv_pool_fits, engine_config, require_engine_dependencies
from hybridkv.cli.http_server import (
    add_connection_limits,
    add_max_request_bytes,
    add_shutdown_timeout,
    bind_socket,
    http_protocol,
    quiet_probe_logs,
    require_server_dependencies,
    uvicorn_server,
)
from hybridkv.cli.model_dir import resolve_model_source
from hybridkv.cli.options import int_range
from hybridkv.errors import InvalidArgumentError
from hybridkv.protocol import HASH_FORMS
from hybridkv.scheduler.config import ENGINE_MAX_NUM_SEQS

__all__ = ["add_parser", "run"]

PREFIX = "hybridkv serve"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve a model (an installed name, a .gguf file or a model directory) "
                                          "over OpenAI's HTTP API, with Prometheus metrics and KV cache events.")
    p.add_argument("model", metavar="MODEL",
                   help="gemma-3-270m, smollm2-135m, a .gguf file, or a model directory (or its config.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int_range(0, 65535), default=8000, help="port; 0 picks a free one (default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: MODEL as given, or its directory's name)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health, /metrics, /get_load and "
                        "/version (default: none); repeat it for several keys, which tell clients apart (their "
                        "shares and --max-*-per-client limits)")
    p.add_argument("--client-id-header", default=None, metavar="NAME",
                   help="the header a gateway in front sets to the caller's id (e.g. X-Client-Id): requests with "
                        "one id share one client's running slots and limits; requests without it are one "
                        "anonymous client (default: clients told apart by API key only)")
    p.add_argument("--max-seqs-per-client", type=int_range(1), default=None, metavar="N",
                   help="unfinished sequences (prompts x n) one client may hold; past it 429 with Retry-After "
                        "(default: no limit; needs --client-id-header or two or more --api-key)")
    p.add_argument("--max-tokens-per-client", type=int_range(1), default=None, metavar="N",
                   help="prompt tokens of one client's unfinished sequences at most; past it 429 with "
                        "Retry-After (default: no limit; needs --client-id-header or two or more --api-key)")
    p.add_argument("--max-waiting", type=int_range(1), default=256,
                   help="requests waiting at most; past it 503 with Retry-After (default 256)")
    add_max_request_bytes(p)
    add_connection_limits(p)
    p.add_argument("--shutdown", choices=("drain", "abort"), default="drain",
                   help="on SIGTERM: let running requests finish (for --shutdown-timeout), or end them at once "
                        "(default drain)")
    add_shutdown_timeout(p, "requests")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish KV cache events over ZMQ (vLLM's wire format), e.g. tcp://127.0.0.1:5557 (default: off)")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="ZMQ endpoint answering replay requests for missed events (default: none)")
    p.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="topic of the event messages, e.g. llm-d's kv@POD@MODEL (default empty)")
    p.add_argument("--kv-events-hash", choices=HASH_FORMS, default="int",
                   help="block hashes on the wire: int (vLLM's default: each hash folded to 64 bits, what Dynamo "
                        "and vLLM consumers decode) or bytes (the whole digest) (default int)")
    p.add_argument("--allowed-origins", type=_origins, default=("*",), metavar="JSON",
                   help='origins browsers may call from (CORS), a JSON list as vLLM\'s, e.g. \'["https://a.example"]\'; '
                        "'[]' turns CORS off (default [\"*\"])")
    p.add_argument("--queued-prefix", choices=("refresh", "pin", "none"), default="refresh",
                   help="keep the cached prefix a queued request will hit until it runs: refresh (mark it used "
                        "on arrival and at every step while it waits), pin (hold it; released first when the pool "
                        "runs short), none (vLLM's behaviour) (default refresh)")
    p.add_argument("--tool-call-parser", choices=("hermes",), default=None,
                   help="parse tool calls out of the output for tool_choice 'auto' (vLLM's flag; hermes: "
                        "<tool_call>{...}</tool_call>); default: none, and tool_choice 'auto' is refused")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning",
                   help="server log level (default warning)")
    add_engine_options(p, max_num_seqs_default=str(ENGINE_MAX_NUM_SEQS))
    p.set_defaults(func=run)
    return p


def _origins(text: str) -> tuple[str, ...]:
    """``--allowed-origins``: a JSON list of non-empty strings."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(o, str) and o for o in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of origins such as \'["*"]\', got {text!r}')
    return tuple(value)


def _model_name(args: argparse.Namespace, source) -> str:
    """--served-model-name, else an installed model's name, a GGUF file's stem, a directory's name."""
    from pathlib import Path

    from hybridkv.checkpoint.installed import INSTALLED_MODELS

    if args.served_model_name:
        return args.served_model_name
    if source.name in INSTALLED_MODELS:
        return source.name
    return Path(source.path).stem if source.kind == "gguf" else Path(source.path).name


def run(args: argparse.Namespace) -> int:
    from hybridkv.server.config import ServerConfig

    source = resolve_model_source(args.model)
    config = ServerConfig(
        model_name=_model_name(args, source), host=args.host, port=args.port,
        api_key=None if args.api_key is None else tuple(args.api_key), client_id_header=args.client_id_header,
        max_seqs_per_client=args.max_seqs_per_client, max_tokens_per_client=args.max_tokens_per_client,
        max_waiting=args.max_waiting, shutdown=args.shutdown, shutdown_timeout=args.shutdown_timeout,
        max_request_bytes=args.max_request_bytes, tool_call_parser=args.tool_call_parser,
        kv_events=args.kv_events, kv_events_replay=args.kv_events_replay, kv_events_topic=args.kv_events_topic,
        kv_events_hash=args.kv_events_hash, allowed_origins=args.allowed_origins,
    )
    if args.num_blocks is not None and args.kv_cache_memory is not None:
        raise InvalidArgumentError("give --num-blocks or --kv-cache-memory, not both")
    require_server_dependencies(config.kv_events is not None)
    require_engine_dependencies("serve")
    from hybridkv.planner.presets import load_model_config

    loaded = load_model_config(source.path)
    check_kv_pool_fits(args, loaded.config, loaded.label)
    sock = bind_socket(config.host, config.port)  # a port in use is refused before the model loads
    try:
        return _serve(args, config, source, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, config, source, sock: socket.socket) -> int:
    import dataclasses

    import uvicorn

    from hybridkv.server.build import build_app

    engine_cfg = dataclasses.replace(engine_config(args, ENGINE_MAX_NUM_SEQS), queued_prefix=args.queued_prefix)
    app = build_app(source, engine=engine_cfg, server=config)
    front, publisher = app.state.front, app.state.front.kv_publisher
    logging.basicConfig(level=args.log_level.upper(), format=f"{PREFIX}: %(levelname)s %(message)s")
    host, port = sock.getsockname()[:2]
    ready = f"{PREFIX}: listening on http://{host}:{port} (model {config.model_name})"
    if publisher is not None:
        ready += f"; KV events on {publisher.endpoint}"
        if publisher.replay_endpoint is not None:
            ready += f", replay on {publisher.replay_endpoint}"
    uv_config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level in ("debug", "info"),
                               http=http_protocol(args))
    quiet_probe_logs(args.log_level)
    deadline = 0.0 if config.shutdown == "abort" else config.shutdown_timeout
    server = uvicorn_server(uv_config, ready, front.close_admission, front.abort_for_shutdown, deadline)
    server.run(sockets=[sock])
    if app.state.final_blocks is None:
        print(f"{PREFIX}: error: the server did not start", file=sys.stderr)
        return 1
    free, usable = app.state.final_blocks
    print(f"{PREFIX}: stopped; {free} of {usable} KV cache blocks free", file=sys.stderr, flush=True)
    return 0 if free == usable else 1
