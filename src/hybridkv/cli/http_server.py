"""What ``hybridkv serve`` and ``hybridkv route`` share: the server extra's check, a bound
listening socket (port 0: an ephemeral one, refused with one line when in use), and
uvicorn's server with our ready line and SIGTERM handling."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import socket
import sys
import threading

from hybridkv.errors import InvalidArgumentError, InvalidConfigError

__all__ = ["add_connection_limits", "add_max_request_bytes", "add_shutdown_timeout", "bind_socket", "http_protocol",
           "require_server_dependencies", "uvicorn_server"]


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


def add_connection_limits(parser) -> None:
    """``--request-timeout`` and ``--max-connections`` (serve and route): see
    :mod:`hybridkv.protocol.connections`; :func:`http_protocol` applies them."""
    from hybridkv.cli.options import finite_float, int_range

    parser.add_argument("--request-timeout", type=finite_float(0.0, low_open=True), default=30.0, metavar="SECONDS",
                        help="a request's headers and body must all arrive within SECONDS of its start (the "
                             "connection, or its first byte on a kept-alive one), else 408 and the connection "
                             "closes; responses are not timed, and a connection idle between requests closes "
                             "after 5 s (default 30)")
    parser.add_argument("--max-connections", type=int_range(1), default=1024, metavar="N",
                        help="connections open at once; one more gets 503 with Retry-After and is closed "
                             "(default 1024)")


def add_shutdown_timeout(parser, what: str) -> None:
    """``--shutdown-timeout`` (serve and route; ``--drain-timeout``, serve's old name for it, is taken too)."""
    from hybridkv.cli.options import finite_float

    parser.add_argument("--shutdown-timeout", "--drain-timeout", dest="shutdown_timeout", type=finite_float(0.0),
                        default=30.0, metavar="SECONDS",
                        help=f"on SIGTERM or Ctrl-C: new requests get 503 at once, a request still arriving is "
                             f"closed, {what} in flight get SECONDS to finish; then each is ended (a stream with an "
                             f"error event) and the process exits (default 30)")


def http_protocol(args):
    """uvicorn's ``http=`` protocol class for parsed ``args`` (:func:`add_connection_limits`)."""
    from hybridkv.protocol.connections import ConnectionLimits, limited_protocol

    return limited_protocol(ConnectionLimits(request_timeout=args.request_timeout,
                                             max_connections=args.max_connections))


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


#: seconds after the shutdown deadline's end of every request before the connections still open are closed
CLOSE_AFTER_DEADLINE = 1.0

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


def uvicorn_server(uv_config, ready_line: str, on_signal, on_deadline, shutdown_timeout: float):
    """uvicorn's server, printing ``ready_line`` once it listens and turning the first SIGTERM
    or SIGINT into an orderly stop: ``on_signal()`` at once (admission closed), uvicorn's
    shutdown (no new connections; requests still arriving closed by
    :class:`~hybridkv.protocol.connections.LimitedH11Protocol`; requests in flight go on), and
    ``on_deadline()`` ``shutdown_timeout`` seconds later (what is left ended) unless the server
    has stopped. Both callables must be safe from a signal handler and from a timer thread."""
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
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if self.started:
                print(ready_line, file=sys.stderr, flush=True)

        def run(self, sockets=None):
            try:
                return super().run(sockets=sockets)
            finally:
                if self.timer is not None:  # stopped before the deadline: nothing left to end
                    self.timer.cancel()

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                on_signal()
                if shutdown_timeout <= 0:
                    self.deadline()
                else:
                    self.timer = threading.Timer(shutdown_timeout, self.deadline)
                    self.timer.daemon = True
                    self.timer.start()
            super().handle_exit(sig, frame)

        def deadline(self) -> None:
            """End what is left; a second later close every connection still open (a client
            that stopped reading would otherwise hold its response, and the process, open)."""
            on_deadline()
            loop = getattr(self, "loop", None)
            try:
                loop.call_soon_threadsafe(loop.call_later, CLOSE_AFTER_DEADLINE, self.close_connections)
            except (AttributeError, RuntimeError):  # no loop yet, or it has closed: nothing is open
                pass

        def close_connections(self) -> None:
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None and not transport.is_closing():
                    transport.close()

    uv_config.timeout_graceful_shutdown = shutdown_timeout + 5  # a backstop: on_deadline ends everything first
    server = Server(uv_config)
    server.timer = None
    return server
