"""Scheduler limits: a small frozen config, separate from the KV cache layout."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hybridkv.errors import InvalidConfigError

__all__ = ["SchedulerConfig"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step limits.

    * ``max_num_batched_tokens``: tokens computed per step (decode tokens and
      prefill chunks together); a prompt longer than the remaining budget is
      prefilled in chunks (chunked prefill).
    * ``max_num_seqs``: running requests at most.
    * ``max_model_len``: prompt + output tokens of one request at most.
    """

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = 256
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidConfigError(f"{name} must be a positive int, got {value!r}")
