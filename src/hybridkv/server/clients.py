"""Who a request comes from, and how much one client may hold at once.

    clients = Clients(config)
    client = clients.identify(request.headers)     # "id:alice", "key:1", or None
    release = clients.admit(client, num_seqs=4, num_tokens=120, param="n")   # or RateLimitError (429)
    ...                                             # the request runs
    release()                                       # its response ended (idempotent)

**Identity.** With ``client_id_header`` set (``--client-id-header``: a gateway in front
writes the caller's id there), a request's client is ``id:<value>``; a request without the
header is the one anonymous client ``id:`` (leaving it out never escapes a limit). Else,
with two or more API keys, the key presented: ``key:<its index>``. Else no identity: one
key, or none, cannot tell clients apart (per-client limits are then refused at start-up).

**Shares.** The identity is the scheduler's share key (:mod:`hybridkv.scheduler.shares`):
a client's requests share its running slots. A request with no identity is its own share.

**Limits** (each optional; ``ServerConfig``): ``max_seqs_per_client`` sequences (prompts
× ``n``) and ``max_tokens_per_client`` prompt tokens (summed over those sequences) that one
client has submitted and whose response has not ended. A request that would take its
client past either gets :class:`~hybridkv.errors.RateLimitError` (429 with
``Retry-After``; OpenAI's type ``requests`` or ``tokens``); a request past a limit on its
own could never run and is a 400 naming ``param``. All of it runs on the event loop:
nothing here locks.

Example (``max_seqs_per_client=8``): alice holds a 6-prompt request; her 3-prompt request
gets 429 (6 + 3 > 8), her 2-prompt request runs (8); a 9-prompt request is a 400 naming
``prompt``; bob's requests count apart from hers.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping

from hybridkv.errors import InvalidArgumentError, RateLimitError

__all__ = ["Clients", "ANONYMOUS"]

#: the client of a request without ``client_id_header`` when it is set
ANONYMOUS = "id:"


class Clients:
    """Identities and per-client limits for a :class:`~hybridkv.server.config.ServerConfig`."""

    def __init__(self, config) -> None:
        self.header = None if config.client_id_header is None else config.client_id_header.lower()
        keys = config.api_keys
        #: the Authorization header's whole value (as the app's key check compares it) -> identity
        self.keys = {f"Bearer {key}": f"key:{i}" for i, key in enumerate(keys)} if len(keys) > 1 else {}
        self.max_seqs = config.max_seqs_per_client
        self.max_tokens = config.max_tokens_per_client
        self.retry_after = config.retry_after
        self.seqs: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()

    def identify(self, headers: Mapping[str, str]) -> str | None:
        """The client of a request with these (case-insensitive) headers; see the module docstring."""
        if self.header is not None:
            return "id:" + headers.get(self.header, "").strip()
        return self.keys.get(headers.get("authorization", "")) if self.keys else None

    def admit(self, client: str | None, num_seqs: int, num_tokens: int, param: str) -> Callable[[], None]:
        """Count a request of ``num_seqs`` sequences and ``num_tokens`` prompt tokens for
        ``client`` (None: not counted); the callable that uncounts it (once). Raises as the
        module docstring says, counting nothing."""
        for limit, have, want, kind, what in ((self.max_seqs, self.seqs, num_seqs, "requests", "sequences"),
                                              (self.max_tokens, self.tokens, num_tokens, "tokens", "prompt tokens")):
            if limit is None or client is None:
                continue
            if want > limit:
                raise InvalidArgumentError(f"this request has {want} {what}; one client may have at most {limit} "
                                           "unfinished", param=param)
            if have[client] + want > limit:
                raise RateLimitError(f"this client has {have[client]} {what} unfinished; with this request's "
                                     f"{want} that passes the {limit} one client may have: retry once some finish",
                                     limit=kind, retry_after=self.retry_after)
        if client is None or (self.max_seqs is None and self.max_tokens is None):
            return _nothing
        self.seqs[client] += num_seqs
        self.tokens[client] += num_tokens
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                for counter, n in ((self.seqs, num_seqs), (self.tokens, num_tokens)):
                    counter[client] -= n
                    if not counter[client]:
                        del counter[client]

        return release

    def held(self, client: str) -> tuple[int, int]:
        """(sequences, prompt tokens) ``client`` holds now."""
        return self.seqs[client], self.tokens[client]


def _nothing() -> None:
    return None
