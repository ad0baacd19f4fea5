"""Scheduler limits and admission policy: a small frozen config, separate from the KV cache layout."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

from hybridkv.errors import InvalidConfigError

__all__ = ["SchedulerConfig", "ADMISSION_POLICIES", "QUEUED_PREFIX_POLICIES", "DEFAULT_ADMISSION",
           "DEFAULT_QUEUED_PREFIX", "DEFAULT_MAX_NUM_SEQS", "ENGINE_MAX_NUM_SEQS"]

#: running requests at most: the bare scheduler's default (vLLM's)
DEFAULT_MAX_NUM_SEQS = 256
#: ... and the engine's (``EngineConfig``, ``serve``): a batch sized for a CPU
ENGINE_MAX_NUM_SEQS = 64

#: ``admission`` values: what must fit the pool before a waiting request is admitted (the default first)
ADMISSION_POLICIES = ("full_prompt", "first_chunk")
DEFAULT_ADMISSION = ADMISSION_POLICIES[0]
#: ``queued_prefix`` values: how a queued request's cached prefix is kept until it runs (the default first)
QUEUED_PREFIX_POLICIES = ("none", "refresh", "pin")
DEFAULT_QUEUED_PREFIX = QUEUED_PREFIX_POLICIES[0]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step limits and the admission policy.

    * ``max_num_batched_tokens``: tokens computed per step (decode tokens and
      prefill chunks together); a prompt longer than the remaining budget is
      prefilled in chunks (chunked prefill).
    * ``max_num_seqs``: running requests at most.
    * ``max_model_len``: prompt + output tokens of one request at most; a prompt
      must leave room for one output token (shorter than ``max_model_len``).
    * ``admission``: when a waiting request may start.

      - ``"full_prompt"`` (default, vLLM's default ``scheduler_reserve_full_isl=True``):
        only if the pool's free blocks could hold all its tokens (the prompt; for a
        preempted request the prompt and the tokens generated so far) beside its
        prefix hit, each sliding-window / chunked-local group counted at most at its
        spec's per-request bound (``KVCacheSpec.max_num_blocks(max_model_len,
        max_num_batched_tokens)``), *and* its first chunk can be allocated now.
        Block 16, full + chunked 256 groups, budget 512, a 2000-token prompt, no hit:
        125 full + min(125, 48) chunked = 173 free blocks needed, not the 64 of a
        512-token first chunk.
      - ``"first_chunk"`` (vLLM's ``scheduler_reserve_full_isl=False``): as soon as its
        first chunk fits. Admits more, then preempts more when later chunks don't fit.
    * ``queued_prefix``: what happens to the cached prefix a request will hit while it
      waits in the queue (a router sent it here because of that prefix; the requests
      queued before it allocate meanwhile):

      - ``"none"`` (default, vLLM's): nothing, it may be evicted;
      - ``"refresh"`` (the server's): marked as just used on arrival
        (:meth:`~hybridkv.core.kv_cache_manager.KVCacheManager.refresh_prefix_hit`), and
        again at the start of every step while it waits (the first
        ``REFRESH_WAITING`` of the queue, its head last), so other cached blocks, those
        that finished requests free meanwhile included, are evicted first;
      - ``"pin"``: held on arrival (:mod:`hybridkv.core.prefix_pins`) until admission;
        when the pool runs short the most recent pins are released first, before any
        running request is preempted.
    """

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int = 8192
    admission: str = DEFAULT_ADMISSION
    queued_prefix: str = DEFAULT_QUEUED_PREFIX

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidConfigError(f"{name} must be a positive int, got {value!r}")
        if self.queued_prefix not in QUEUED_PREFIX_POLICIES:
            raise InvalidConfigError(f"queued_prefix must be one of {QUEUED_PREFIX_POLICIES}, got {self.queued_prefix!r}")
        if self.admission not in ADMISSION_POLICIES:
            raise InvalidConfigError(f"admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}")
