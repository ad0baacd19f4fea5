"""The engine thread's side of one running request: its record, its logprobs, its end report.

:class:`~hybridkv.server.async_llm.AsyncLLM`'s engine thread keeps one :class:`LiveRequest`
per request it added, from ``add`` until the request's last chunk. Everything here runs in
that thread, between engine steps (nothing of the event loop's is touched):

* text comes from the request's :class:`~hybridkv.engine.llm.TextStream` (incremental
  detokenizer, stop strings); ``token_times`` records when each output token came (for
  the metrics' inter-token latencies);
* :func:`token_logprobs`: with ``logprobs`` a chunk carries, per new token, its
  log-probability under the model's raw distribution (before temperature, vLLM's
  default) and the ``logprobs`` most likely alternatives, from the engine's last logits;
* :func:`report_finished`: once per finished request, a DEBUG line on the
  ``hybridkv.server`` logger (its prefix hit when queued, at its first and last
  admission: a benchmark joins it to the response of the same request id) and, with
  metrics, one :class:`~hybridkv.server.metrics.FinishedRecord`.
"""

from __future__ import annotations

import logging
from typing import Any

from hybridkv.engine.llm import TextStream
from hybridkv.protocol.openai import wire_finish_reason
from hybridkv.server.submission import Submission, TokenLogprob

__all__ = ["LiveRequest", "report_finished", "token_logprobs"]

log = logging.getLogger("hybridkv.server")


class LiveRequest:
    """The engine thread's record of one running request: prompt ``index`` of ``sub``."""

    __slots__ = ("sub", "index", "text", "num_logprobs", "token_times")

    def __init__(self, sub: Submission, index: int, text: TextStream, num_logprobs: int | None) -> None:
        self.sub, self.index, self.text = sub, index, text
        self.num_logprobs = num_logprobs
        self.token_times: list[float] = []


def token_logprobs(engine: Any, rid: str, new: tuple[int, ...], k: int) -> tuple[TokenLogprob, ...] | None:
    """The logprob of request ``rid``'s newest token and its ``k`` top alternatives, from
    ``engine.last_logits`` (None: no logits kept for it, or no new token)."""
    import torch

    logits = engine.last_logits.get(rid)
    if logits is None or not new:
        return None
    lp = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(lp, min(k, lp.shape[0]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    # one sampled token per request per step: the last logits are the last token's
    return tuple(TokenLogprob(t, float(lp[t]), top) for t in new[-1:])


def report_finished(metrics: Any, live: LiveRequest, out: Any, reason: str | None = None) -> None:
    """Log (DEBUG) and record (``metrics.on_request_finished``, when metrics) a request that
    ended with output ``out``; ``reason`` overrides ``out.finish_reason`` (a stop string)."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("request %s %s: %d prompt tokens; prefix hit %d when queued, %d at admission, %d at the "
                  "last admission (%d preemptions); %d output tokens", out.request_id, reason or out.finish_reason,
                  len(out.prompt_token_ids), out.arrival_hit_tokens, out.num_cached_tokens, out.last_hit_tokens,
                  out.num_preemptions, len(out.output_token_ids))
    if metrics is None:
        return
    from hybridkv.server.metrics import FinishedRecord

    finish = reason or out.finish_reason
    metrics.on_request_finished(
        FinishedRecord(
            arrival_time=out.arrival_time,
            first_token_time=out.first_token_time,
            token_times=tuple(live.token_times),
            finished_time=out.finished_time,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=len(out.output_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            finish_reason=wire_finish_reason(finish),
        )
    )
