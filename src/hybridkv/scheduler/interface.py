"""What the scheduler hands a model runner each step, and what comes back.

Torch-free. The scheduler decides, per step, which requests compute which tokens;
the runner (a real model in ``hybridkv.engine`` or a fake one in tests) computes
them and returns one sampled token for every request whose ``sample`` flag is set.

Block tables are per KV cache group: ``block_ids[g][i]`` holds the tokens
``[i * block_size, (i + 1) * block_size)`` of the request in group ``g``. Block id 0
is the shared null block: it stands for tokens no future token attends to (out of
the sliding window / before the current chunk) and must never be read or written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from hybridkv.sampling_params import SamplingParams, check_context  # re-exported: their home is neutral

__all__ = ["SamplingParams", "ScheduledRequest", "SchedulerOutput", "ModelRunner", "check_context"]


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's work in one step.

    ``token_ids`` are the tokens to compute now, at positions
    ``num_computed_tokens .. num_computed_tokens + len(token_ids) - 1``.
    ``sample`` is True when the last of them is the request's last known token
    (prefill finished or a decode step), so the runner must return a new token.
    ``num_output_tokens`` counts tokens sampled so far (seeded sampling and ``min_tokens`` use it).

    ``all_token_ids`` is the request's whole token list (prompt, then outputs) for the
    penalties of its ``sampling`` (:attr:`SamplingParams.penalized`): a live reference to the
    scheduler's list, not a copy, so it costs nothing per step. This step's history is its
    first ``num_prompt_tokens + num_output_tokens`` entries (the list grows when the step's
    token is appended: read it during the step only). None: no history given (a request
    whose sampling is penalized then cannot sample). Left out of ``==`` and ``repr``.
    """

    request_id: str
    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: tuple[Sequence[int], ...]
    sample: bool
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_output_tokens: int = 0
    all_token_ids: Sequence[int] | None = field(default=None, compare=False, repr=False)
    num_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """All the work of one step plus the requests that left since the last one."""

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    finished_request_ids: tuple[str, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)


class ModelRunner(Protocol):
    """Computes a step; returns request id -> sampled token for requests with ``sample``."""

    def execute(self, output: SchedulerOutput) -> dict[str, int]: ...
