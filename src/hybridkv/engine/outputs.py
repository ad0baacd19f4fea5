"""What the engine hands out per request: its output when it finished, what it did in one step,
and the engine's bookkeeping of it while it runs (times, tokens reported, prompt scores)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.errors import InvariantViolation

__all__ = ["Progress", "RequestDelta", "RequestOutput", "prompt_scores"]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request. Times are ``time.perf_counter()`` seconds."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str  # "stop", "length", "aborted" or "error" (the model failed on it: see ``error``)
    num_cached_tokens: int
    num_preemptions: int
    arrival_time: float = 0.0
    first_token_time: float | None = None  # None: aborted before its first token
    finished_time: float = 0.0
    #: the prefix hit when it was queued (``SchedulerConfig.queued_prefix`` refresh / pin; 0
    #: with none) and at its latest admission (``num_cached_tokens`` is the first's)
    arrival_hit_tokens: int = 0
    last_hit_tokens: int = 0
    #: why a request ended with ``"error"`` (None otherwise)
    error: str | None = None
    #: with ``SamplingParams.prompt_logprobs``: per prompt position, None for the first, then
    #: :class:`~hybridkv.engine.prompt_logprobs.PromptLogprob` (None otherwise)
    prompt_logprobs: tuple | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one request did in one step: the tokens it gained (vLLM's delta output) and,
    if it finished in the step, its :class:`RequestOutput`."""

    request_id: str
    new_token_ids: tuple[int, ...]
    output: RequestOutput | None = None
    #: the request's prompt logprobs, in the step it samples its first token (see RequestOutput)
    prompt_logprobs: tuple | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None

    @property
    def finish_reason(self) -> str | None:
        return None if self.output is None else self.output.finish_reason


class Progress:
    """The engine's bookkeeping of a live request: when it came, first token, tokens reported."""

    __slots__ = ("arrival_time", "first_token_time", "reported", "scores", "prompt_logprobs")

    def __init__(self, arrival_time: float, score_prompt: bool = False) -> None:
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.reported = 0
        #: prompt position -> its PromptLogprob, while the prompt is scored (a recompute overwrites)
        self.scores: dict | None = {} if score_prompt else None
        #: the finished scores, once its first token came (then nothing is scored again)
        self.prompt_logprobs: tuple | None = None


def prompt_scores(request_id: str, num_prompt: int, scores: dict) -> tuple:
    """(None, position 1's value, ..., position P - 1's) from ``scores`` (position -> value):
    every position was computed (a scored request takes no prefix hit; a recompute wrote its
    positions again); a missing one is an InvariantViolation."""
    missing = [p for p in range(1, num_prompt) if p not in scores]
    if missing:
        raise InvariantViolation(f"request {request_id!r}: prompt positions {missing[:5]} were never scored")
    return (None, *(scores[p] for p in range(1, num_prompt)))
