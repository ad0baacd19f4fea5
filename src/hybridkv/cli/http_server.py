"""What ``hybridkv serve`` and ``hybridkv route`` share: the server extra's check, a bound
listening socket (port 0: an ephemeral one, refused with one line when in use), and
uvicorn's server with our ready line and SIGTERM handling."""

from __future__ import annotations

import contextlib
import importlib
import logging
import signal
import socket
import sys
import threading

from hybridkv.errors import InvalidArgumentError, InvalidConfigError

__all__ = ["add_max_request_bytes", "bind_socket", "require_server_dependencies", "uvicorn_server"]


def require_server_dependencies(kv_events: bool, command: str = "serve", extra: tuple[str, ...] = ()) -> None:
    """Refuse (one line, exit 2 in the CLI) a ``command`` whose [server] modules are missing."""
    needed = ["fastapi", "uvicorn", "prometheus_client", *extra] + (["zmq", "msgspec"] if kv_events else [])
    for module in needed:
        try:
            importlib.import_module(module)
        except ImportError:
            raise InvalidConfigError(
                f"{command} needs {module}, which is not installed: pip install 'hybridkv[server]'"
            ) from None


def add_max_request_bytes(parser) -> None:
    """``--max-request-bytes`` (serve and route): a larger body is a 413 before anything parses it."""
    from hybridkv.cli.options import int_range
    from hybridkv.protocol.limits import DEFAULT_MAX_REQUEST_BYTES

    parser.add_argument("--max-request-bytes", type=int_range(1), default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                        help=f"refuse request bodies larger than N bytes with 413 (default "
                             f"{DEFAULT_MAX_REQUEST_BYTES:,}: {DEFAULT_MAX_REQUEST_BYTES / 2**20:g} MiB)")


def bind_socket(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidArgumentError(f"--host {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


#: routes load balancers and scrapers poll: their access lines are debug, not info
PROBE_PATHS = ("/health", "/metrics")


class QuietProbes(logging.Filter):
    """Drops uvicorn's access lines for :data:`PROBE_PATHS` (at ``--log-level info`` a
    health-checked server logged mostly probes); ``--log-level debug`` keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in PROBE_PATHS
        return True


def quiet_probe_logs(log_level: str) -> None:
    """Above debug, keep probes out of uvicorn's access log (call after ``uvicorn.Config``)."""
    if log_level != "debug":
        logging.getLogger("uvicorn.access").addFilter(QuietProbes())


def uvicorn_server(uv_config, front, config, ready_line: str):
    """uvicorn's server, printing ``ready_line`` once it listens and turning SIGTERM into an
    orderly stop: admission closed first, then drain (with a timer) or abort (with ``front``
    None, the router's, only the first)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises a caught SIGTERM once it has stopped, which would kill the
            # process before it reports the pool; ours stops and exits with a status instead
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                print(ready_line, file=sys.stderr, flush=True)

        def handle_exit(self, sig, frame):
            if not self.should_exit and front is not None:
                front.close_admission()
                if config.shutdown == "abort":
                    front.abort_all()
                else:
                    timer = threading.Timer(config.drain_timeout, front.abort_all)
                    timer.daemon = True
                    timer.start()
            super().handle_exit(sig, frame)

    return Server(uv_config)
