"""Picking the next token from logits, per request's :class:`SamplingParams`.

Greedy (temperature 0) is ``argmax``. Otherwise: divide by temperature, keep the
``top_k`` largest, keep the smallest set whose probability reaches ``top_p``, and
draw with a ``torch.Generator`` seeded from ``(seed, num_output_tokens)``, so a
request with a seed gets the same tokens however it is batched, preempted or
recomputed. Requests without a seed draw from the sampler's own generator.

On a GPU (or with ``Sampler(on_device=True)``) a step's rows are sampled in one batch
where the logits are: temperature, top-k and top-p as one set of tensor ops, then an
exponential race (``argmax(p / E)``, ``E ~ Exp(1)``: an exact draw from ``p``) whose noise
comes from a generator seeded per row as above (the rows without a seed share the
sampler's device generator). The only host synchronisation is reading the chosen ids.
The CPU default keeps the row-by-row ``multinomial`` (its seeded tokens stay as they were).
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybridkv.sampling_params import SamplingParams

__all__ = ["Sampler", "filtered_probs", "step_seed"]

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, num_output_tokens: int) -> int:
    """A 63-bit seed for sampling output token ``num_output_tokens`` of a request with ``seed``."""
    x = (seed * 0x9E3779B97F4A7C15 + num_output_tokens * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _MASK64
    return x ^ (x >> 29)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [N, vocab] -> fp32 probabilities [N, vocab] after each row's temperature (1 for a
    greedy row), top-k (ties with the k-th kept) and top-p (the smallest set whose mass reaches
    it; a token whose higher-ranked mass already reaches ``top_p`` is dropped)."""
    device, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    x = logits.float() / temps.unsqueeze(1)  # [N, V]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        vals = torch.topk(x, max(top_k), dim=-1).values  # [N, kmax] descending
        kth = vals.gather(1, torch.tensor(top_k, device=device).sub_(1).clamp_(max=vals.shape[1] - 1).unsqueeze(1))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [N, V]
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)  # [N, 1]
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, -1) - sorted_probs  # mass strictly above each token
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill_(before >= top_p, 0.0))
    return probs


class Sampler:
    def __init__(self, seed: int = 0, on_device: bool = False) -> None:
        self.seed = seed
        self._unseeded = torch.Generator(device="cpu")
        self._unseeded.manual_seed(seed)
        #: sample batched where the logits are, also on a CPU (always on other devices)
        self.on_device = on_device
        self._device_unseeded: dict[torch.device, torch.Generator] = {}

    def sample_rows(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], num_output_tokens: Sequence[int]
    ) -> list[int]:
        """logits [N, vocab] -> one token per row; all greedy rows in one ``argmax``.

        Rows are drawn in order, so unseeded draws come out as from :meth:`sample` row by row
        (on the CPU path; batched on a device: :meth:`sample_batched`).
        """
        if self.on_device or logits.device.type != "cpu":
            return self.sample_batched(logits, params, num_output_tokens)
        greedy = torch.argmax(logits, dim=-1).tolist() if any(p.greedy for p in params) else []
        return [
            greedy[row] if p.greedy else self.sample(logits[row], p, n)
            for row, (p, n) in enumerate(zip(params, num_output_tokens))
        ]

    def sample(self, logits: torch.Tensor, params: SamplingParams, num_output_tokens: int) -> int:
        """logits [vocab] -> one token id."""
        if params.greedy:
            return int(torch.argmax(logits))
        probs = filtered_probs(logits.float().cpu().unsqueeze(0), [params])[0]  # [V]
        if params.seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(step_seed(params.seed, num_output_tokens))
        else:
            gen = self._unseeded
        return int(torch.multinomial(probs, 1, generator=gen))

    def sample_batched(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], num_output_tokens: Sequence[int]
    ) -> list[int]:
        """logits [N, vocab] -> one token per row, every row at once where the logits are."""
        device = logits.device
        greedy = [p.greedy for p in params]
        best = torch.argmax(logits, dim=-1)  # [N]
        if all(greedy):
            return best.tolist()
        probs = filtered_probs(logits, params)  # [N, V]
        noise = torch.empty_like(probs)  # [N, V] Exp(1): argmax(p / E) draws from p
        noise.exponential_(generator=self._device_generator(device))
        for row, (p, count) in enumerate(zip(params, num_output_tokens)):
            if p.seed is not None and not p.greedy:
                gen = torch.Generator(device=device)
                gen.manual_seed(step_seed(p.seed, count))
                noise[row].exponential_(generator=gen)
        drawn = torch.argmax(probs / noise.clamp_(min=1e-20), dim=-1)  # [N]
        return torch.where(torch.tensor(greedy, device=device), best, drawn).tolist()

    def _device_generator(self, device: torch.device) -> torch.Generator:
        gen = self._device_unseeded.get(device)
        if gen is None:
            gen = self._device_unseeded[device] = torch.Generator(device=device)
            gen.manual_seed(self.seed)
        return gen
