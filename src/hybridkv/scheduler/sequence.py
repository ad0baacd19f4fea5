"""The scheduler's view of a request: the core Request plus sampling and status."""

from __future__ import annotations

import enum

from hybridkv.core.request import Request
from hybridkv.sampling_params import SamplingParams

__all__ = ["Sequence", "SequenceStatus", "FinishReason"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks freed; recomputed when readmitted
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached (or max_model_len)
    STOP = "stop"  # a stop token was sampled
    ABORTED = "aborted"
    ERROR = "error"  # the model failed on it (a step that ran it alone raised, or its logits were not numbers)


class Sequence:
    """A request moving through the scheduler. ``request`` carries tokens and KV progress."""

    __slots__ = (
        "request",
        "sampling",
        "status",
        "arrival_step",
        "admitted_step",
        "first_token_step",
        "finished_step",
        "finish_reason",
        "num_preemptions",
        "num_cached_tokens",
        "last_hit_tokens",
        "arrival_hit_tokens",
        "share_key",
    )

    def __init__(self, request: Request, sampling: SamplingParams, arrival_step: int = 0,
                 share_key: str | None = None):
        self.request = request
        self.sampling = sampling
        self.status = SequenceStatus.WAITING
        self.arrival_step = arrival_step
        self.admitted_step: int | None = None
        self.first_token_step: int | None = None
        self.finished_step: int | None = None
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        #: prefix-hit tokens at the first admission (vLLM's ``num_cached_tokens``: what a
        #: response reports as cached), and at the latest (after a preemption)
        self.num_cached_tokens = 0
        self.last_hit_tokens = 0
        #: prefix-hit tokens when it was queued (with ``queued_prefix`` refresh or pin; 0
        #: otherwise): what a router that chose this replica could have seen
        self.arrival_hit_tokens = 0
        #: whose share of the running slots it takes (:mod:`hybridkv.scheduler.shares`); None: its own
        self.share_key = share_key

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        r = self.request
        return f"Sequence({r.request_id!r}, {self.status.value}, computed={r.num_computed_tokens}/{r.num_tokens})"
