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

Defined for every accepted value (the same rules on both paths):

- A temperature below :data:`~hybridkv.sampling_params.GREEDY_BELOW` samples greedily
  (:attr:`SamplingParams.greedy`); above the largest fp32 it divides as the largest fp32.
  Logits are shifted by their row's maximum before the division, so no finite temperature
  turns a finite logit into ``inf`` or ``nan``.
- top-k and top-p always keep the most likely token (top-p ``5e-324`` is greedy).
- A row whose logits hold ``nan`` or ``+inf``, or nothing above ``-inf``, is a *model
  fault*: :meth:`Sampler.sample_rows` returns :data:`FAULT` for it (the engine ends that
  request with an error); the other rows are sampled as if it were not there.

Before either path, :meth:`Sampler.sample_rows` applies each row's logit bias, ``min_tokens``
and penalties to the raw logits (:func:`~hybridkv.engine.penalties.apply_penalties`, vLLM's
order), once for the whole step, so both paths sample the same adjusted logits; a step with
none of them samples its logits as they are. A row that ``min_tokens`` leaves with nothing
above ``-inf`` is a fault row by the rule above; the adjustments keep a ``nan`` / ``+inf``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybridkv.engine.penalties import apply_penalties
from hybridkv.engine.structured import mask_logits
from hybridkv.sampling_params import SamplingParams

__all__ = ["FAULT", "Sampler", "filtered_probs", "step_seed"]

_MASK64 = (1 << 63) - 1
#: what :meth:`Sampler.sample_rows` returns for a row whose logits are a model fault
FAULT = -1
_FP32_MAX = float(torch.finfo(torch.float32).max)


def step_seed(seed: int, num_output_tokens: int) -> int:
    """A 63-bit seed for sampling output token ``num_output_tokens`` of a request with ``seed``
    (in [0, 2**64)). The arithmetic is modulo 2**63, so a seed's top bit enters as a constant of
    its own: ``seed`` and ``seed + 2**63`` draw different streams (they would otherwise be one)."""
    x = (seed * 0x9E3779B97F4A7C15 + num_output_tokens * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    if seed >> 63:
        x ^= 0x5851F42D4C957F2D
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _MASK64
    return x ^ (x >> 29)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [N, vocab] -> fp32 probabilities [N, vocab] after each row's temperature (1 for a
    greedy row), top-k (ties with the k-th kept) and top-p (the smallest set whose mass reaches
    it; a token whose higher-ranked mass already reaches ``top_p`` is dropped; the most likely
    token is always kept). A row without a finite maximum (a model fault: see the module
    docstring) comes out uniform; callers do not sample it."""
    device, vocab = logits.device, logits.shape[-1]
    x = logits.float()
    top = x.amax(dim=-1, keepdim=True)  # [N, 1]
    ok = torch.isfinite(top)
    # shifted: every logit <= 0 and the row's best exactly 0, whatever the temperature
    x = torch.where(ok, x - torch.where(ok, top, 0.0), 0.0)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:  # ranked before the temperature, which may merge nearby logits
        vals = torch.topk(x, max(top_k), dim=-1).values  # [N, kmax] descending
        kth = vals.gather(1, torch.tensor(top_k, device=device).sub_(1).clamp_(max=vals.shape[1] - 1).unsqueeze(1))
        x = x.masked_fill(x < kth, float("-inf"))
    temps = torch.tensor([1.0 if p.greedy else min(p.temperature, _FP32_MAX) for p in params], device=device)
    ranked = x  # [N, V]: the ranking top-p walks, before a temperature rounds nearby logits together
    x = x / temps.unsqueeze(1)  # -inf stays -inf, the best stays 0
    probs = torch.softmax(x, dim=-1)  # [N, V]: the best token's probability >= 1 / V
    if any(p.top_p < 1.0 for p in params):
        # a row at 1.0 keeps everything (its cumulative sum may round past 1)
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params],
                             device=device).unsqueeze(1)  # [N, 1]
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices  # first: the argmax
        sorted_probs = probs.gather(1, order)
        before = torch.cumsum(sorted_probs, -1) - sorted_probs  # mass strictly above each token
        drop = before >= top_p
        drop[:, 0] = False  # the best token stays, however small top_p is (5e-324 is 0 in fp32)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill_(drop, 0.0))
    return probs


def fault_rows(row_max: torch.Tensor) -> torch.Tensor:
    """Per row, from its maximum logit [N]: True where the row is a model fault (``nan`` or
    ``+inf`` in it, or all ``-inf``: ``max`` propagates ``nan``) -> bool [N]."""
    return ~torch.isfinite(row_max)


class Sampler:
    def __init__(self, seed: int = 0, on_device: bool = False) -> None:
        self.seed = seed
        self._unseeded = torch.Generator(device="cpu")
        self._unseeded.manual_seed(seed)
        #: sample batched where the logits are, also on a CPU (always on other devices)
        self.on_device = on_device
        self._device_unseeded: dict[torch.device, torch.Generator] = {}

    def sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        token_ids: Sequence[Sequence[int] | None] | None = None,
        num_prompt_tokens: Sequence[int] | None = None,
        allowed: tuple[Sequence[int], torch.Tensor] | None = None,
    ) -> list[int]:
        """logits [N, vocab] -> one token per row (:data:`FAULT` for a model-fault row); all
        greedy rows in one ``max``, which also finds the fault rows.

        Each row's bias, ``min_tokens`` and penalties first (:func:`apply_penalties`: row ``i``'s
        history is ``token_ids[i]``, its first ``num_prompt_tokens[i]`` ids the prompt; only
        penalized rows need one). Then ``allowed`` (rows, their token bitmask: a grammar's, from
        :meth:`~hybridkv.engine.structured.StructuredOutputs.masks`): ``-inf`` at each token those
        rows may not take (:func:`~hybridkv.engine.structured.mask_logits`), before either path.
        Rows are drawn in order, so unseeded draws come out as from
        :meth:`sample` row by row (on the CPU path; batched on a device: :meth:`sample_batched`).
        """
        logits = apply_penalties(logits, params, num_output_tokens, token_ids, num_prompt_tokens)  # [N, vocab]
        if allowed is not None:
            logits = mask_logits(logits, *allowed)
        if self.on_device or logits.device.type != "cpu":
            return self.sample_batched(logits, params, num_output_tokens)
        row_max, best = torch.max(logits, dim=-1)  # [N], [N]
        faults = fault_rows(row_max).tolist()
        greedy = best.tolist()
        return [
            FAULT if bad else greedy[row] if p.greedy else self._draw(logits[row], p, n)
            for row, (p, n, bad) in enumerate(zip(params, num_output_tokens, faults))
        ]

    def sample(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        num_output_tokens: int,
        token_ids: Sequence[int] | None = None,
        num_prompt_tokens: int = 0,
    ) -> int:
        """logits [vocab] -> one token id (:data:`FAULT` for a model-fault row); ``token_ids``:
        the prompt (its first ``num_prompt_tokens``) and output so far, for the penalties."""
        return self.sample_rows(logits.unsqueeze(0), [params], [num_output_tokens], [token_ids], [num_prompt_tokens])[0]

    def _draw(self, logits: torch.Tensor, params: SamplingParams, num_output_tokens: int) -> int:
        """One draw from a non-greedy, fault-free row logits [vocab]."""
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
        """logits [N, vocab] -> one token per row, every row at once where the logits are. The
        logits are sampled as given: the bias and penalties are :meth:`sample_rows`'s."""
        device = logits.device
        greedy = [p.greedy for p in params]
        row_max, best = torch.max(logits, dim=-1)  # [N], [N]
        faults = fault_rows(row_max)  # [N]
        if not all(greedy):
            probs = filtered_probs(logits, params)  # [N, V]
            noise = torch.empty_like(probs)  # [N, V] Exp(1): argmax(p / E) draws from p
            noise.exponential_(generator=self._device_generator(device))
            for row, (p, count) in enumerate(zip(params, num_output_tokens)):
                if p.seed is not None and not p.greedy:
                    gen = torch.Generator(device=device)
                    gen.manual_seed(step_seed(p.seed, count))
                    noise[row].exponential_(generator=gen)
            drawn = torch.argmax(probs / noise.clamp_(min=1e-20), dim=-1)  # [N]
            best = torch.where(torch.tensor(greedy, device=device), best, drawn)
        return torch.where(faults, FAULT, best).tolist()

    def _device_generator(self, device: torch.device) -> torch.Generator:
        gen = self._device_unseeded.get(device)
        if gen is None:
            gen = self._device_unseeded[device] = torch.Generator(device=device)
            gen.manual_seed(self.seed)
        return gen
