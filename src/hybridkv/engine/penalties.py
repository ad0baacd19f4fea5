"""Logit bias, ``min_tokens`` and the repetition / frequency / presence penalties of a step's
rows, applied to its raw logits in one pass before the sampler's temperature, top-k and top-p.

vLLM's definitions (``vllm/v1/sample``: the logit-bias and min-tokens logits processors, then
``apply_penalties``), in vLLM's order, per row of :class:`~hybridkv.sampling_params.SamplingParams`:

1. ``logit_bias``: ``logit[t] += bias`` for each (t, bias) pair.
2. ``min_tokens``: while the row has fewer output tokens, ``logit[t] = -inf`` for each of its
   ``stop_token_ids`` (EOS included after ``with_eos``) inside the vocabulary.
3. ``repetition_penalty`` ``r``: each token of the prompt or the output so far gets
   ``logit / r`` if ``logit > 0``, else ``logit * r``.
4. ``frequency_penalty`` ``f``, ``presence_penalty`` ``p``, over the output tokens only:
   ``logit -= f * count``, then ``logit -= p * (count > 0)``.

Numerics: the logits come out fp32 (vLLM samples in fp32; a bf16 logit is exact in fp32).
A finite logit stays finite: a repetition penalty that overflows fp32 saturates at
``±finfo(float32).max``, and a penalty outside fp32's normal range acts as its nearest normal
fp32 value. A ``nan`` or ``+inf`` logit is left as it is, ``min_tokens`` included, so a
model-fault row stays one (:mod:`hybridkv.engine.sampling`). A row that ``min_tokens`` leaves
with nothing above ``-inf`` (every token of the vocabulary a stop token) is a fault row too:
the sampler returns FAULT for it, nothing raises. ``logit_bias`` -100 is a bias, never -inf.

One pass: the rows that change are picked in Python (:func:`adjusts`); if there are none the
logits are returned as they are (the same tensor: no copy, no kernel). Otherwise those rows are
gathered once into an fp32 [M, vocab] block; the biases and min-token masks are scattered in
with one indexed op each; one ``index_add_`` counts every penalized row's output tokens
([M, vocab] int32), one scatter marks its prompt tokens for the repetition penalty; the
penalties are then a few elementwise ops over the block with per-row values (neutral values
leave a row bit-identical), and the block is copied back over those rows. Every op is
elementwise or per-row, so a row's result does not depend on its batch. Index lists are built
and checked on the host, so a bad id is a typed error, never a device-side assert.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybridkv.errors import InvalidArgumentError
from hybridkv.sampling_params import SamplingParams

__all__ = ["adjusts", "apply_penalties"]

_FP32_MAX = float(torch.finfo(torch.float32).max)
_FP32_TINY = float(torch.finfo(torch.float32).tiny)  # the smallest normal fp32
_INF = float("inf")


def adjusts(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether :func:`apply_penalties` changes a row: a logit bias, ``min_tokens`` still holding
    stop ids back, or a penalty on."""
    return bool(params.logit_bias) or params.penalized or (
        num_output_tokens < params.min_tokens and bool(params.stop_token_ids)
    )


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    token_ids: Sequence[Sequence[int] | None] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
) -> torch.Tensor:
    """logits [N, vocab] -> logits [N, vocab] with each row's bias, ``min_tokens`` and penalties
    (the module docstring's rules); ``logits`` itself (untouched) when no row changes, else a new
    fp32 tensor (``logits`` is never written). Row ``i``'s history is ``token_ids[i]``: its prompt
    (the first ``num_prompt_tokens[i]`` ids) then its ``num_output_tokens[i]`` output ids, the
    rest ignored; only the penalized rows (:attr:`SamplingParams.penalized`) read it.

    InvalidArgumentError: a ``logit_bias`` id outside the vocabulary (param ``logit_bias``), a
    penalized row without its history, or a history id outside the vocabulary.
    """
    rows = [i for i, (p, n) in enumerate(zip(params, num_output_tokens)) if adjusts(p, n)]
    if not rows:
        return logits
    num_rows, vocab = logits.shape
    device = logits.device
    out = logits.to(torch.float32, copy=True)  # [N, V]
    whole = len(rows) == num_rows
    index = None if whole else torch.tensor(rows, device=device)
    x = out if whole else out.index_select(0, index)  # [M, V]: the rows that change
    sel = [params[i] for i in rows]
    _add_bias(x, sel, vocab)
    _hold_stops(x, sel, [num_output_tokens[i] for i in rows], vocab)
    if any(p.penalized for p in sel):
        x = _penalize(x, sel, rows, num_output_tokens, token_ids, num_prompt_tokens)
    if whole:
        return x
    return out.index_copy_(0, index, x)


def _add_bias(x: torch.Tensor, sel: Sequence[SamplingParams], vocab: int) -> None:
    """x [M, V] += each row's logit bias, in place."""
    r: list[int] = []
    t: list[int] = []
    b: list[float] = []
    for j, p in enumerate(sel):
        if p.logit_bias:
            p.check_vocab(vocab)
            for token, bias in p.logit_bias:
                r.append(j)
                t.append(token)
                b.append(bias)
    if r:
        at = (torch.tensor(r, device=x.device), torch.tensor(t, device=x.device))
        x.index_put_(at, x[at] + torch.tensor(b, dtype=torch.float32, device=x.device))  # ids unique per row


def _hold_stops(x: torch.Tensor, sel: Sequence[SamplingParams], counts: Sequence[int], vocab: int) -> None:
    """x [M, V]: ``-inf`` at the stop ids of the rows below their ``min_tokens``, in place; a
    ``nan`` or ``+inf`` there stays (a fault row stays one)."""
    r: list[int] = []
    t: list[int] = []
    for j, (p, n) in enumerate(zip(sel, counts)):
        if n < p.min_tokens:
            stops = [s for s in p.stop_token_ids if s < vocab]  # an id outside the vocabulary never comes out
            r += [j] * len(stops)
            t += stops
    if r:
        at = (torch.tensor(r, device=x.device), torch.tensor(t, device=x.device))
        held = x[at]
        x.index_put_(at, torch.where(held < _INF, -_INF, held))  # nan < inf is False


def _ids(token_ids: Sequence[int], vocab: int, row: int) -> torch.Tensor:
    """A row's history ids -> int64 [L] on the host; InvalidArgumentError for an id outside [0, vocab)."""
    ids = torch.tensor(token_ids, dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise InvalidArgumentError(f"row {row}: a token id of its history is outside the vocabulary of {vocab}")
    return ids


def _penalize(
    x: torch.Tensor,
    sel: Sequence[SamplingParams],
    rows: Sequence[int],
    num_output_tokens: Sequence[int],
    token_ids: Sequence[Sequence[int] | None] | None,
    num_prompt_tokens: Sequence[int] | None,
) -> torch.Tensor:
    """x [M, V] -> x with the repetition, frequency and presence penalties (rows without them
    come out bit-identical)."""
    num, vocab = x.shape
    device = x.device
    out_flat: list[torch.Tensor] = []  # j * V + id of each output token of penalized row j
    prompt_flat: list[torch.Tensor] = []  # the same for the prompts of the repetition-penalized rows
    for j, (p, i) in enumerate(zip(sel, rows)):
        if not p.penalized:
            continue
        history = token_ids[i] if token_ids is not None else None
        if history is None or num_prompt_tokens is None:
            raise InvalidArgumentError(f"row {i}: its penalties need the request's token ids (none given)")
        start, n = num_prompt_tokens[i], num_output_tokens[i]
        if len(history) < start + n:
            raise InvalidArgumentError(
                f"row {i}: {len(history)} token ids given, its prompt and output hold {start} + {n}"
            )
        out_flat.append(_ids(history[start : start + n], vocab, i) + j * vocab)
        if p.repetition_penalty != 1.0:
            prompt_flat.append(_ids(history[:start], vocab, i) + j * vocab)
    flat = torch.cat(out_flat).to(device)
    counts = torch.zeros(num * vocab, dtype=torch.int32, device=device)
    counts = counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).view(num, vocab)  # [M, V]
    seen = counts > 0  # [M, V]: in the output so far
    if prompt_flat:
        reps = torch.tensor([min(max(p.repetition_penalty, _FP32_TINY), _FP32_MAX) for p in sel],
                            dtype=torch.float32, device=device).unsqueeze(1)  # [M, 1]
        in_history = seen.clone()
        in_history.view(-1)[torch.cat(prompt_flat).to(device)] = True  # [M, V]: in the prompt or the output
        factor = torch.where(in_history, reps, 1.0)  # [M, V]
        penalized = torch.where(x > 0, x / factor, x * factor)
        x = torch.where(torch.isfinite(x), penalized.clamp(-_FP32_MAX, _FP32_MAX), penalized)
    if any(p.frequency_penalty != 0.0 for p in sel):
        freq = torch.tensor([p.frequency_penalty for p in sel], dtype=torch.float32, device=device).unsqueeze(1)
        x = x - freq * counts  # [M, V]
    if any(p.presence_penalty != 0.0 for p in sel):
        pres = torch.tensor([p.presence_penalty for p in sel], dtype=torch.float32, device=device).unsqueeze(1)
        x = x - pres * seen
    return x
