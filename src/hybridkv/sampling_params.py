"""How a request samples and when it stops, and whether it fits the context: the one
home of these rules (the engine, the scheduler, the server and the CLI import them).

Torch-free. A bad value is an InvalidArgumentError naming the parameter (``param``), which
the server reports in OpenAI's error body as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from hybridkv.errors import InvalidArgumentError, PromptTooLongError

__all__ = ["GREEDY_BELOW", "SamplingParams", "check_context"]

#: a temperature below this samples greedily (vLLM's ``_SAMPLING_EPS``): dividing logits by
#: less would only re-rank ties by rounding, and 1e-300 would overflow fp32
GREEDY_BELOW = 1e-5


def _real(x: Any) -> bool:
    """A real number that a float holds (a 400-digit int does not)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """The request's prompt and its ``max_tokens`` must fit ``max_model_len`` (OpenAI's and vLLM's
    rule: refused, never silently capped); the one rule of ``serve`` and of the text front
    (``LLM``, ``generate``). PromptTooLongError otherwise."""
    if prompt_len >= max_model_len:
        why = "exceeds" if prompt_len > max_model_len else "leaves no room for an output token within"
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; a prompt of {prompt_len} "
            f"tokens {why} max_model_len {max_model_len}"
        )
    if prompt_len + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion)"
        )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token, and when to stop. A temperature below :data:`GREEDY_BELOW`
    (0 included) is greedy (argmax); top-k and top-p always keep the most likely token.

    A request ends after ``max_tokens`` tokens or at the first sampled token in
    ``stop_token_ids`` (kept in the output, as vLLM and HF do). The scheduler knows no
    model, so it stops only at ``stop_token_ids``; the engine adds the model's EOS ids
    (:meth:`with_eos`) unless ``ignore_eos`` is set, which leaves ``stop_token_ids``
    in force (vLLM's defaults and meaning). ``stop`` strings end a request when its
    decoded text contains one; the text front (:class:`hybridkv.engine.llm.LLM`) applies
    them and leaves the stop string out of the text (vLLM's meaning); the scheduler
    and engine, which see token ids only, ignore them.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}", param="max_tokens")
        if not _real(self.temperature) or not 0 <= self.temperature < float("inf"):  # nan fails both comparisons
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                                       param="temperature")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be 0 (off) or a positive int, got {self.top_k!r}", param="top_k")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidArgumentError(f"seed must be an int, got {self.seed!r}", param="seed")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            stop = (None,)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop):
            raise InvalidArgumentError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r:.80}",
                                       param="stop_token_ids")
        object.__setattr__(self, "stop_token_ids", stop)
        strings = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            strings = tuple(strings)
        except TypeError:
            strings = (None,)
        if any(not isinstance(t, str) or not t for t in strings):
            raise InvalidArgumentError(f"stop must be non-empty strings, got {self.stop!r:.80}", param="stop")
        object.__setattr__(self, "stop", tuple(dict.fromkeys(strings)))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def with_eos(self, eos_token_ids: Sequence[int]) -> "SamplingParams":
        """These params with the model's EOS ids added to ``stop_token_ids`` (self if
        ``ignore_eos`` or nothing to add)."""
        extra = tuple(t for t in dict.fromkeys(eos_token_ids) if t not in self.stop_token_ids)
        if self.ignore_eos or not extra:
            return self
        return replace(self, stop_token_ids=self.stop_token_ids + extra)
