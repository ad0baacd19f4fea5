"""How the server runs: a small frozen config beside the engine's :class:`EngineConfig`.

    ServerConfig(model_name="gemma-3-270m", port=0, max_waiting=128)

``max_waiting`` bounds the requests queued but not yet running (submitted ones the
engine thread has not taken in count too); past it a request gets 503 with
``Retry-After``. ``shutdown`` says what SIGTERM does to requests already running:
``"drain"`` lets them finish (at most ``shutdown_timeout`` seconds, then aborts what is
left: a stream ends with an error event, a whole response is a 503), ``"abort"`` ends
them so at once. Either way admission stops first, a request still arriving is closed
with 503, and the process exits with every block of the pool free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hybridkv.errors import InvalidConfigError
from hybridkv.protocol import HASH_FORMS
from hybridkv.protocol.limits import DEFAULT_MAX_REQUEST_BYTES

__all__ = ["ServerConfig", "SHUTDOWN_MODES", "TOOL_CALL_PARSERS"]

SHUTDOWN_MODES = ("drain", "abort")
#: the formats ``tool_choice: "auto"`` can parse calls out of (``--tool-call-parser``, vLLM's names)
TOOL_CALL_PARSERS = ("hermes",)
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name (RFC 9110's token)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_name: str = "model"
    host: str = "127.0.0.1"
    port: int = 8000  # 0: an ephemeral port (the CLI prints the one it got)
    #: when set (a key, or a tuple of keys: vLLM's ``--api-key``), every route but /health and /metrics needs
    #: ``Authorization: Bearer <one of them>``; two or more tell clients apart (:mod:`hybridkv.server.clients`)
    api_key: str | tuple[str, ...] | None = None
    max_waiting: int = 256
    max_prompts_per_request: int = 64  # a /v1/completions prompt list longer than this is refused
    shutdown: str = "drain"
    shutdown_timeout: float = 30.0  # seconds "drain" gives requests in flight (``--shutdown-timeout``)
    retry_after: int = 1  # seconds, in 503 responses
    kv_events: str | None = None  # ZMQ endpoint to publish KV events on, e.g. tcp://127.0.0.1:5557
    kv_events_replay: str | None = None  # ZMQ ROUTER endpoint answering replay requests
    kv_events_topic: str = ""  # e.g. llm-d's kv@<pod>@<model>
    kv_events_hash: str = "int"  # block hashes on the wire: "int" (vLLM's default, 64-bit) or "bytes"
    #: a request body larger than this is refused with 413 before it is parsed (``--max-request-bytes``)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    #: origins a browser may call from (CORS; vLLM's ``--allowed-origins``, default any); () : no CORS
    allowed_origins: tuple[str, ...] = ("*",)
    #: how ``tool_choice: "auto"`` finds calls in the output (``--tool-call-parser``); None: "auto" is a 400
    tool_call_parser: str | None = None
    #: a header a gateway sets to the caller's id (``--client-id-header``): the client of
    #: :mod:`hybridkv.server.clients` (its share of running slots, its limits)
    client_id_header: str | None = None
    #: one client's unfinished sequences (prompts × n) and their prompt tokens at most (429
    #: past them); None: no limit. Needs clients told apart: ``client_id_header`` or two API keys
    max_seqs_per_client: int | None = None
    max_tokens_per_client: int | None = None

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The API keys, as a tuple (empty: none)."""
        key = self.api_key
        return () if key is None else (key,) if isinstance(key, str) else key

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise InvalidConfigError(f"model_name must be a non-empty str, got {self.model_name!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidConfigError(f"port must be an int in [0, 65535], got {self.port!r}")
        for name in ("max_waiting", "max_prompts_per_request", "retry_after", "max_request_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.shutdown not in SHUTDOWN_MODES:
            raise InvalidConfigError(f"shutdown must be one of {SHUTDOWN_MODES}, got {self.shutdown!r}")
        t = self.shutdown_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise InvalidConfigError(f"shutdown_timeout must be a finite number >= 0, got {t!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise InvalidConfigError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS} or None, got "
                                     f"{self.tool_call_parser!r}")
        if not isinstance(self.allowed_origins, tuple) or not all(isinstance(o, str) and o for o in self.allowed_origins):
            raise InvalidConfigError(f"allowed_origins must be a tuple of non-empty str, got {self.allowed_origins!r}")
        key = self.api_key
        if key is not None and not (isinstance(key, str) and key or isinstance(key, tuple) and key
                                    and all(isinstance(k, str) and k for k in key)):
            raise InvalidConfigError(f"api_key must be a non-empty str or a tuple of them, got {key!r:.40}")
        header = self.client_id_header
        if header is not None and (not isinstance(header, str) or not _TOKEN.fullmatch(header)):
            raise InvalidConfigError(f"client_id_header must be an HTTP header name, got {header!r:.40}")
        for name in ("max_seqs_per_client", "max_tokens_per_client"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidConfigError(f"{name} must be an int >= 1 or None, got {value!r}")
            if value is not None and header is None and len(self.api_keys) < 2:
                raise InvalidConfigError(f"{name} needs clients told apart: a client id header "
                                         "(--client-id-header) or two or more API keys")
        if self.kv_events_hash not in HASH_FORMS:
            raise InvalidConfigError(f"kv_events_hash must be one of {HASH_FORMS}, got {self.kv_events_hash!r}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise InvalidConfigError("a KV events replay endpoint needs a KV events endpoint")
