"""Logprobs in OpenAI's and vLLM's response shapes, from the engine's values.

* completions (OpenAI's legacy shape): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, one entry per token. With ``echo`` the prompt's tokens come first, the
  first prompt token's value and alternatives ``null`` (nothing precedes it), as OpenAI's
  legacy API and vLLM answer; ``text_offset`` is the token's first character in the
  choice's whole text (the echoed prompt included), across streamed chunks too.
* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
* vLLM's ``prompt_logprobs``: ``[null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]``,
  each position's dict holding the prompt token and the top ``k`` alternatives.

A token's text is that id decoded alone (special tokens kept); a value that is not finite
(a token the model rules out) is written as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["LogprobFormat"]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class LogprobFormat:
    """The response shapes above for one model's ``tokenizer`` (None: empty token texts)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return self.text([token_id])

    def text(self, token_ids: Sequence[int]) -> str:
        """``token_ids`` as text, special tokens kept ("" without a tokenizer)."""
        tok = self.tokenizer
        return "" if tok is None else tok.decode(list(token_ids), skip_special_tokens=False)

    def completion(self, lps: Sequence | None, offset: int = 0, prompt: tuple | None = None,
                   prompt_k: int = 0) -> dict | None:
        """OpenAI's completion logprobs of the generated ``lps`` (TokenLogprob), after the prompt's
        when ``prompt`` (its token ids and their scores: ``(ids, PromptLogprob-or-None per
        position)``) is given with its top ``prompt_k``; ``text_offset`` counts from ``offset``."""
        if lps is None and prompt is None:
            return None
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict | None] = []
        if prompt is not None:
            ids, scores = prompt
            for token_id, s in zip(ids, scores):
                tokens.append(self.token_text(token_id))
                values.append(None if s is None else _finite(s.logprob))
                tops.append(None if s is None else {self.token_text(i): _finite(v) for i, v in s.top[:prompt_k]})
        for t in lps or ():
            tokens.append(self.token_text(t.token_id))
            values.append(_finite(t.logprob))
            tops.append({self.token_text(i): _finite(v) for i, v in t.top})
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, lps: Sequence | None) -> dict | None:
        """OpenAI's chat logprobs of the generated ``lps`` (TokenLogprob)."""
        if lps is None:
            return None

        def entry(token_id: int, value: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _finite(value), "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                            for t in lps]}

    def prompt_logprobs(self, scores: Sequence | None, k: int) -> list | None:
        """vLLM's ``prompt_logprobs`` of a choice: per prompt position (None for the first) the
        prompt token and the top ``k``, by id (as a string), with their ranks."""
        if scores is None:
            return None
        out: list[dict | None] = []
        for s in scores:
            if s is None:
                out.append(None)
                continue
            entry = {str(i): {"logprob": _finite(v), "rank": r, "decoded_token": self.token_text(i)}
                     for r, (i, v) in enumerate(s.top[:k], start=1)}
            entry.setdefault(str(s.token_id), {"logprob": _finite(s.logprob), "rank": s.rank,
                                               "decoded_token": self.token_text(s.token_id)})
            out.append(entry)
        return out
