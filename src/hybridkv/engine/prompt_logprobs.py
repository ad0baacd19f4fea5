"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and the
``k`` most likely alternatives there (vLLM's ``prompt_logprobs``; OpenAI's legacy completions
``echo`` with ``logprobs``).

The value of prompt position ``p`` (``1 <= p < P``) comes from the final hidden state of
position ``p - 1``, so a prefill chunk over positions ``[c, c + q)`` gives positions
``c + 1 .. min(c + q, P - 1)``; position 0 has none (``None``, as vLLM). A request's rows go
through the output projection in slices of :func:`slice_rows` rows, and of each row only the
chosen token's value and the top ``k`` are kept: Gemma's 262,144-token vocabulary would make a
2,048-row chunk's fp32 logits 2 GiB; a slice is at most ``SLICE_ELEMENTS`` logits.

Worked example (P = 6, chunks of 4): chunk 1 (positions 0-3) gives positions 1-4 from rows
0-3; chunk 2 (positions 4-5) gives position 5 from row 0 (row 1, position 5, predicts the
first output token: the sampler's, not a prompt value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["PromptLogprob", "SLICE_ELEMENTS", "chunk_targets", "prompt_logprobs", "slice_rows"]
#: logits computed at once per slice of rows (fp32: 64 MiB)
SLICE_ELEMENTS = 1 << 24


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """One prompt token's log-probability, its rank (1 + the tokens strictly more likely) and
    the top alternatives ``(token_id, logprob)``, most likely first (``k`` of them; none for 0)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int = 1


def slice_rows(vocab: int) -> int:
    """Rows of logits computed at once for a vocabulary of ``vocab``: 64 for 262,144."""
    return max(1, SLICE_ELEMENTS // max(vocab, 1))


def chunk_targets(prompt: Sequence[int], num_computed: int, num_new: int) -> list[int]:
    """The prompt tokens a chunk's rows score: ``prompt[c + 1 : min(c + q, P - 1) + 1]`` for a
    chunk from ``c`` over ``q`` tokens (empty once the chunk is past the prompt).

    >>> chunk_targets([9, 8, 7, 6, 5, 4], 0, 4), chunk_targets([9, 8, 7, 6, 5, 4], 4, 2)
    ([8, 7, 6, 5], [4])
    """
    end = min(num_computed + num_new, len(prompt) - 1)
    return list(prompt[num_computed + 1 : end + 1])


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: Sequence[int], k: int,
    vocab: int,
) -> list[PromptLogprob]:
    """hidden [n, H] (the rows of positions ``c .. c + n - 1``) and the ``n`` tokens they
    predict -> one :class:`PromptLogprob` each, the logits [<= slice, vocab] made in slices
    by ``compute_logits`` (the model's output projection, soft-capping included)."""
    out: list[PromptLogprob] = []
    step = slice_rows(vocab)
    for start in range(0, len(targets), step):
        rows = targets[start : start + step]
        lp = torch.log_softmax(compute_logits(hidden[start : start + len(rows)]).float(), dim=-1)  # [r, V]
        picked = lp.gather(1, torch.tensor(rows, device=lp.device).unsqueeze(1))  # [r, 1]
        ranks = (lp > picked).sum(dim=1).add_(1).tolist()  # [r]
        chosen = picked.squeeze(1).tolist()
        if k:
            vals, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)  # [r, k], most likely first
            tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        else:
            tops = [()] * len(rows)
        out.extend(PromptLogprob(t, c, top, r) for t, c, top, r in zip(rows, chosen, tops, ranks))
    return out
