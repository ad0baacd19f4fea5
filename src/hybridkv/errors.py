"""The one exception tree of hybridkv.

Every error hybridkv raises on bad input derives from :class:`HybridKVError`, so a
caller (and the CLI) can catch one type. Errors that correspond to a builtin kind
also derive from it (``ValueError``, ``KeyError``) so generic handlers still work.

    HybridKVError
    ├── InvalidSpecError          a KV cache spec with impossible values
    ├── InvalidConfigError        a model / cache / scheduler config that cannot be used
    │   └── UnknownArchitectureError
    ├── InvalidArgumentError      a negative count, an unparsable size, ...
    │   ├── ModelNotInstalledError    a known model name whose package is not installed
    │   └── ChatTemplateError         a chat template that fails to render (or is absent)
    ├── RequestError              misuse of the request life cycle
    │   ├── UnknownRequestError
    │   ├── DuplicateRequestError
    │   ├── RequestFreedError     freeing (or using) a request that is already freed
    │   ├── StaleHitError         a prefix hit whose blocks no longer hold the request's prefix
    │   └── PromptTooLongError
    ├── PoolTooSmallError         the block pool cannot hold even one request
    ├── TraceFormatError          a bad line in a workload trace (carries the line number)
    ├── WeightLoadError           unknown / missing / misshaped tensors in a checkpoint
    │   ├── GGUFFormatError           a truncated or non-GGUF file
    │   └── UnsupportedQuantizationError   a GGUF tensor type hybridkv cannot dequantize
    ├── TokenizerError            a tokenizer that cannot be built or does not match the model
    ├── ModelNotFoundError        a request names a model the server does not serve
    ├── ServiceUnavailableError   the server's waiting queue is full, or it is shutting down
    ├── RateLimitError            one client holds as much as the server lets one client hold
    ├── EngineFailedError         the engine raised while running a request (a bug; HTTP 500)
    └── InvariantViolation        check_invariants() found corrupted state (a bug)
"""

from __future__ import annotations

__all__ = [
    "HybridKVError",
    "InvalidSpecError",
    "InvalidConfigError",
    "UnknownArchitectureError",
    "InvalidArgumentError",
    "RequestError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "RequestFreedError",
    "StaleHitError",
    "PromptTooLongError",
    "PoolTooSmallError",
    "TraceFormatError",
    "WeightLoadError",
    "GGUFFormatError",
    "UnsupportedQuantizationError",
    "ModelNotInstalledError",
    "ChatTemplateError",
    "TokenizerError",
    "ModelNotFoundError",
    "ServiceUnavailableError",
    "RateLimitError",
    "EngineFailedError",
    "InvariantViolation",
]


class HybridKVError(Exception):
    """Base class of every error raised by hybridkv."""


class InvalidSpecError(HybridKVError, ValueError):
    """A KV cache spec has an impossible value (block_size <= 0, unknown dtype, ...)."""


class InvalidConfigError(HybridKVError, ValueError):
    """A model, cache or scheduler configuration cannot be used."""


class UnknownArchitectureError(InvalidConfigError):
    """A model config names an architecture hybridkv does not support."""


class InvalidArgumentError(HybridKVError, ValueError):
    """An argument is out of range or unparsable (negative token count, '80XB').

    ``param`` names the offending parameter when there is one (the server reports it in
    OpenAI's error body, as vLLM does)."""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class RequestError(HybridKVError):
    """Misuse of the request life cycle."""


class UnknownRequestError(RequestError, KeyError):
    """An operation names a request the component does not know."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequestError(RequestError):
    """A request id is added twice."""


class RequestFreedError(RequestError):
    """A request is freed (or used) after it was already freed."""


class StaleHitError(RequestError):
    """A prefix hit passed to ``allocate_slots`` is no longer (or never was) the request's
    cached prefix: its blocks were evicted or re-cached since ``get_computed_blocks``
    found them, or the hit was found for other tokens. Nothing was changed; look the
    hit up again."""


class PromptTooLongError(RequestError, ValueError):
    """A prompt (plus its requested output) does not fit the model or the pool."""


class PoolTooSmallError(HybridKVError):
    """The block pool (or memory budget) cannot hold even a single request."""


class TraceFormatError(HybridKVError, ValueError):
    """A workload trace line is malformed; ``line`` is its 1-based number."""

    def __init__(self, message: str, line: int | None = None, path: str | None = None):
        self.line = line
        self.path = path
        where = ""
        if path is not None:
            where = f"{path}:"
        if line is not None:
            where += f"{line}: " if where else f"line {line}: "
        elif where:
            where += " "
        super().__init__(f"{where}{message}")


class WeightLoadError(HybridKVError):
    """A checkpoint has unknown, missing or misshaped tensors."""


class GGUFFormatError(WeightLoadError):
    """A file is not GGUF, or is a truncated / malformed one."""


class UnsupportedQuantizationError(WeightLoadError):
    """A GGUF tensor is stored in a type hybridkv cannot dequantize (the message names the supported ones)."""


class ModelNotInstalledError(InvalidArgumentError):
    """A known model name (``gemma-3-270m``) whose package is not installed; the message gives the pip line."""


class ChatTemplateError(InvalidArgumentError):
    """A chat template is absent, does not parse, or raises while rendering (``raise_exception``)."""


class TokenizerError(HybridKVError, ValueError):
    """A tokenizer cannot be built from its files / metadata, or does not match the model's vocabulary."""


class ModelNotFoundError(HybridKVError, LookupError):
    """A request names a model the server does not serve (HTTP 404, ``model_not_found``)."""

    param = "model"


class ServiceUnavailableError(HybridKVError):
    """The server cannot take a request now: its waiting queue is full or it is shutting
    down (HTTP 503 with ``Retry-After``). ``retry_after`` is in seconds."""

    def __init__(self, *args: object, retry_after: int = 1) -> None:
        super().__init__(*args)
        self.retry_after = retry_after


class RateLimitError(HybridKVError):
    """A client already holds what the server lets one client hold (``--max-seqs-per-client``
    sequences or ``--max-tokens-per-client`` prompt tokens unfinished): HTTP 429 with
    ``Retry-After`` (seconds), OpenAI's ``rate_limit_exceeded``. ``limit`` is OpenAI's error
    type for it: ``"requests"`` or ``"tokens"``."""

    def __init__(self, *args: object, limit: str = "requests", retry_after: int = 1) -> None:
        super().__init__(*args)
        self.limit = limit
        self.retry_after = retry_after


class EngineFailedError(HybridKVError):
    """The engine raised while running a request: the request was aborted, the server goes
    on (HTTP 500, without the detail). Always a bug."""


class InvariantViolation(HybridKVError, AssertionError):
    """``check_invariants()`` found corrupted internal state. Always a bug."""
