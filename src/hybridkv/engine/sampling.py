"""Picking the next token from logits, per request's :class:`SamplingParams`.

Greedy (temperature 0) is ``argmax``. Otherwise: divide by temperature, keep the
``top_k`` largest, keep the smallest set whose probability reaches ``top_p``, and
draw with a ``torch.Generator`` seeded from ``(seed, num_output_tokens)``, so a
request with a seed gets the same tokens however it is batched, preempted or
recomputed. Requests without a seed draw from the sampler's own generator.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybridkv.scheduler.interface import SamplingParams

__all__ = ["Sampler", "step_seed"]

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, num_output_tokens: int) -> int:
    """A 63-bit seed for sampling output token ``num_output_tokens`` of a request with ``seed``."""
    x = (seed * 0x9E3779B97F4A7C15 + num_output_tokens * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _MASK64
    return x ^ (x >> 29)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._unseeded = torch.Generator(device="cpu")
        self._unseeded.manual_seed(seed)

    def sample_rows(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], num_output_tokens: Sequence[int]
    ) -> list[int]:
        """logits [N, vocab] -> one token per row; all greedy rows in one ``argmax``.

        Rows are drawn in order, so unseeded draws come out as from :meth:`sample` row by row.
        """
        greedy = torch.argmax(logits, dim=-1).tolist() if any(p.greedy for p in params) else []
        return [
            greedy[row] if p.greedy else self.sample(logits[row], p, n)
            for row, (p, n) in enumerate(zip(params, num_output_tokens))
        ]

    def sample(self, logits: torch.Tensor, params: SamplingParams, num_output_tokens: int) -> int:
        """logits [vocab] -> one token id."""
        if params.greedy:
            return int(torch.argmax(logits))
        scaled = logits.float().cpu() / params.temperature  # [V]
        if params.top_k and params.top_k < scaled.shape[0]:
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if params.seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(step_seed(params.seed, num_output_tokens))
        else:
            gen = self._unseeded
        return int(torch.multinomial(probs, 1, generator=gen))
