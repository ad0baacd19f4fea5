"""Misuse checks of what a :class:`~hybridkv.core.kv_cache_manager.KVCacheManager` call names.

Each check raises a typed error from :mod:`hybridkv.errors` and changes nothing; the
manager runs them before it touches a table, so a refused call leaves it as it was:

* :func:`check_request`: a :class:`~hybridkv.core.request.Request` whose block hashes the
  manager can use (made by a manager of the same block size and hash, or with no hasher:
  then it is never cached), else InvalidArgumentError;
* :func:`check_count`: a count argument is a non-negative int (a bool is not), else
  InvalidArgumentError;
* :func:`unknown_request_id`: the error for an id that holds no blocks (UnknownRequestError;
  a non-str id: InvalidArgumentError);
* :func:`request_to_free`: the id ``free`` may release -- UnknownRequestError if it holds no
  blocks, RequestFreedError if it was freed lately, RequestError if another request object
  of that id holds them.

This module reads the manager's state only through its arguments and imports nothing of it.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, NoReturn

from hybridkv.core.request import BlockHasher, Request
from hybridkv.errors import InvalidArgumentError, RequestError, RequestFreedError, UnknownRequestError

__all__ = ["check_count", "check_request", "request_to_free", "unknown_request_id"]


def check_request(request: Any, hasher: BlockHasher | None) -> None:
    """A Request whose hashes a manager with ``hasher`` can use (see the module docstring)."""
    if not isinstance(request, Request):
        raise InvalidArgumentError(f"expected a Request, got {request!r:.60}")
    theirs = request._hasher
    if theirs is not None and theirs is not hasher and not (hasher and hasher.compatible(theirs)):
        raise InvalidArgumentError(
            f"request {request.request_id!r} was hashed with block size {theirs.block_size} or another "
            f"hash; make it with this manager's make_request"
        )


def check_count(name: str, value: Any) -> None:
    """``value`` (the argument ``name``) is a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")


def unknown_request_id(request_id: Any) -> NoReturn:
    """Raise the error for ``request_id``, which holds no blocks."""
    if not isinstance(request_id, str):
        raise InvalidArgumentError(f"a request id must be a str, got {request_id!r:.60}")
    raise UnknownRequestError(f"request {request_id!r} holds no blocks")


def request_to_free(request: Any, live: Mapping[str, Request], freed: Collection[str]) -> str:
    """The id of ``request`` (a Request or its id), which holds blocks in ``live``; ``freed``:
    the ids freed lately (for the error message)."""
    if isinstance(request, str):
        rid = request
    elif isinstance(request, Request):
        rid = request.request_id
    else:
        raise InvalidArgumentError(f"free takes a Request or a request id, got {request!r:.60}")
    holder = live.get(rid)
    if holder is None:
        if rid in freed:
            raise RequestFreedError(f"request {rid!r} was already freed")
        raise UnknownRequestError(f"request {rid!r} holds no blocks")
    if holder is not request and not isinstance(request, str):
        raise RequestError(f"another request with id {rid!r} holds the blocks; this one holds none")
    return rid
