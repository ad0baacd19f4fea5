"""The parts of a completions or chat response that do not need the engine: the echoed prompt
(completions' ``echo``), how many prompt alternatives to score, the wire finish reasons and
OpenAI's usage (each prompt counted once when it has ``n`` samples)."""

from __future__ import annotations

from typing import Any

from hybridkv.errors import InvalidArgumentError
from hybridkv.protocol.openai import CompletionRequest, completion_prompt_list, wire_finish_reason
from hybridkv.sampling_params import MAX_LOGPROBS
from hybridkv.server.logprobs import LogprobFormat

__all__ = ["Echo", "prompt_scoring", "stop_reason", "usage", "wire_reason"]


class Echo:
    """A completions request's ``echo``: each prompt's text, and its tokens with their scores."""

    def __init__(self, fmt: LogprobFormat, req: CompletionRequest, prompts: list[list[int]], n: int = 1) -> None:
        texts = completion_prompt_list(req)
        self.prompts, self.n = prompts, n
        # a text prompt is echoed as sent; token ids as their text (special tokens kept)
        self._texts = [t if isinstance(t, str) else fmt.text(ids)
                       for t, ids in zip(texts, prompts)]

    def text(self, index: int) -> str:
        """Choice ``index``'s prompt text (choice i * n + j is prompt i's)."""
        return self._texts[index // self.n]

    def scores(self, index: int, scored: tuple | None) -> tuple:
        """(the prompt's token ids, their scores): ``scored`` (None for the first), or Nones
        where the prompt was not scored."""
        ids = self.prompts[index // self.n]
        return ids, scored if scored is not None else (None,) * len(ids)


def prompt_scoring(req, echo_logprobs: bool) -> int | None:
    """The top-k the engine scores the prompt with: vLLM's ``prompt_logprobs``, and the
    completions' ``logprobs`` when ``echo`` shows the prompt's; None: no scoring."""
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if echo_logprobs else None) if k is not None]
    if not wanted:
        return None
    k = max(wanted)
    if not 0 <= k <= MAX_LOGPROBS:
        raise InvalidArgumentError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {k}", param="prompt_logprobs")
    return k


def wire_reason(final) -> str | None:
    """OpenAI's finish reason of a choice's last chunk (None before it): vLLM's "abort" for ours "aborted"."""
    if final is None:
        return None
    return wire_finish_reason(final.finish_reason)


def stop_reason(final) -> str | int | None:
    return None if final is None else final.stop_reason


def usage(finals: dict[int, Any], n: int = 1) -> dict:
    """OpenAI's usage of the choices' finals (choice i * n + j: prompt i's sample j): each
    prompt counted once (its first sample's), every sample's completion."""
    prompt = sum(len(f.prompt_token_ids) for i, f in finals.items() if i % n == 0)
    completion = sum(len(f.token_ids) for f in finals.values())
    cached = sum(f.num_cached_tokens for i, f in finals.items() if i % n == 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
