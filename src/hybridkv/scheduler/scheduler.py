"""Continuous batching over a hybrid KV cache: chunked prefill, prefix hits, preemption.

Schedules as vLLM v1's ``Scheduler`` does by default (FCFS, no spec decode, one batch in
flight); ``benchmarks/vs_vllm_scheduler.py`` checks it decision by decision against
vLLM 0.33. Each ``schedule()`` spends a token budget (``max_num_batched_tokens``):

1. Running requests first, in admission order: a decode token, or the next chunk of
   an unfinished prefill, at most ``max_model_len - num_computed_tokens - 1`` tokens
   (the token sampled after them must still fit). If the pool cannot hold a request's
   new slots, the most recently admitted running request is preempted (its blocks
   freed, back to the front of the waiting queue, recomputed later: nothing is lost)
   until it fits; if it preempted itself, no later running request is scheduled.
2. Then, if nobody was preempted this step, waiting requests are admitted in order
   (preempted ones first, oldest first, then new ones by arrival) with their
   prefix-cache hit, while budget, ``max_num_seqs`` and blocks allow. The first that
   does not fit stops admission (no skipping ahead). ``SchedulerConfig.admission``
   says what must fit: the whole prompt, each windowed group at most at its spec's
   per-request bound (``"full_prompt"``, vLLM's default), or only the first chunk
   (``"first_chunk"``). When requests carry a ``share_key`` (one HTTP request's prompts,
   one client's requests), the next one admitted is the first whose key runs fewest, and
   before any admission a slot is made for each waiting key that runs nothing by
   preempting one of the key running most (:mod:`hybridkv.scheduler.shares`).

``allocate_slots`` frees the blocks no future token attends to (outside the window /
before the current chunk) as requests advance, so chunked and sliding groups hand
their blocks back while the request runs. ``update_from_output`` appends the sampled
tokens and frees finished requests; the requests it is told *failed* (a model fault in
their row) end with ``FinishReason.ERROR``.

A step whose model run raised is undone by :meth:`Scheduler.roll_back`
(:mod:`hybridkv.scheduler.isolation`): one request's fault ends only that request.

Example (budget 8, one 10-token prompt, max_tokens 2)::

    step 0: prefill tokens 0-7            (chunked prefill, no sample)
    step 1: prefill tokens 8-9 → sample   (1st output token)
    step 2: decode 1 token → sample       (2nd output token, finished, freed)
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Collection, Sequence as Seq

from hybridkv.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from hybridkv.core.request import Request
from hybridkv.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    InvariantViolation,
    PoolTooSmallError,
    PromptTooLongError,
    UnknownRequestError,
)
from hybridkv.scheduler.config import SchedulerConfig
from hybridkv.scheduler.isolation import FaultIsolation
from hybridkv.scheduler.shares import FairShare, share_of
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.interface import ModelRunner, ScheduledRequest, SchedulerOutput
from hybridkv.scheduler.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["Scheduler"]

#: with ``queued_prefix="refresh"``, the waiting requests whose hits each step refreshes
REFRESH_WAITING = 16


class Scheduler(FaultIsolation, FairShare):
    """Waiting and running queues over one :class:`KVCacheManager`."""

    def __init__(self, kv_cache_manager: KVCacheManager, config: SchedulerConfig):
        if kv_cache_manager.max_model_len < config.max_model_len:
            raise InvalidArgumentError(
                f"KV cache max_model_len {kv_cache_manager.max_model_len} < scheduler max_model_len {config.max_model_len}"
            )
        self.kv = kv_cache_manager
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self.step_count = 0
        self.num_preemptions = 0
        #: steps undone by :meth:`roll_back`, and the requests they preempted
        self.num_rolled_back_steps = 0
        #: requests of a failed step not yet run alone (see the module docstring), in order
        self.suspects: dict[str, None] = {}
        #: unfinished sequences added with a share key, and preemptions made to even shares
        self.num_keyed = 0
        self.num_share_preemptions = 0
        self._finished_since_last: list[str] = []
        self._usable_blocks = kv_cache_manager.usable_blocks

    # -------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling: SamplingParams | None = None,
        share_key: str | None = None,
        **extra,
    ) -> Sequence:
        """Queue a request. Typed errors (nothing queued) for a duplicate id, an empty
        prompt, a prompt of ``max_model_len`` tokens or more (one output token must fit,
        as vLLM requires), or a request the pool could never hold on its own.
        ``share_key`` (a non-empty str): whose share of the running slots it takes
        (:mod:`hybridkv.scheduler.shares`); None, its own."""
        if request_id in self.sequences:
            raise DuplicateRequestError(f"request {request_id!r} already exists")
        if share_key is not None and (not isinstance(share_key, str) or not share_key):
            raise InvalidArgumentError(f"share_key must be a non-empty str or None, got {share_key!r:.60}")
        sampling = sampling or SamplingParams()
        num_prompt, max_len = len(prompt_token_ids), self.config.max_model_len
        if num_prompt >= max_len:
            why = "exceeds" if num_prompt > max_len else "leaves no room for an output token within"
            raise PromptTooLongError(f"request {request_id!r}: prompt of {num_prompt} tokens {why} max_model_len {max_len}")
        total = min(len(prompt_token_ids) + sampling.max_tokens, self.config.max_model_len)
        peak = self.peak_blocks(total)
        if peak > self._usable_blocks:
            raise PoolTooSmallError(
                f"request {request_id!r} ({total} tokens) may need {peak} blocks; the pool has {self._usable_blocks}"
            )
        request = self.kv.make_request(request_id, prompt_token_ids, **extra)
        seq = Sequence(request, sampling, arrival_step=self.step_count, share_key=share_key)
        self.sequences[request_id] = seq
        self.num_keyed += share_key is not None
        self.waiting.append(seq)
        if self.config.queued_prefix == "refresh":
            seq.arrival_hit_tokens = self.kv.refresh_prefix_hit(request)
        elif self.config.queued_prefix == "pin":
            seq.arrival_hit_tokens = self.kv.pins.pin(request)
        return seq

    def peak_blocks(self, num_tokens: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once, all groups: the
        specs' one bound at this scheduler's budget (a prefill chunk is allocated before the
        tokens it pushes out of a window / chunk are freed). Scout-shaped, block 16, chunk
        8192, budget 2048, 100k tokens: full 6250 + 3 × 640 = 8170 blocks.
        """
        return self.kv.kv_cache_config.max_blocks_per_request(num_tokens, self.config.max_num_batched_tokens)

    def abort_request(self, request_id: str) -> None:
        seq = self.sequences.get(request_id)
        if seq is None or seq.is_finished:
            raise UnknownRequestError(f"request {request_id!r} is not queued or running")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.request)
        else:
            self.waiting.remove(seq)
            self.kv.pins.unpin(request_id)
        self._finish(seq, FinishReason.ABORTED)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Decide this step's work. Request progress is advanced as scheduled."""
        kv = self.kv
        budget = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len
        work: list[tuple[Sequence, int, int]] = []  # (seq, computed before, new tokens)
        preempted: list[Sequence] = []

        kv.new_step_starts()
        if self.config.queued_prefix == "refresh" and self.waiting:
            self._refresh_waiting()
        solo = self._next_suspect() if self.suspects else None
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if solo is not None and seq is not solo:
                i += 1
                continue
            req = seq.request
            computed = req.num_computed_tokens
            num_new = min(req.num_tokens - computed, budget, max_len - computed - 1)
            num_new = kv.align_num_new_tokens(req, computed, num_new, self.config.max_num_batched_tokens)
            if num_new <= 0:
                i += 1
                continue
            while kv.allocate_slots(req, num_new) is None:
                if kv.pins.unpin_last():  # queued requests' pins go before running requests
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            work.append((seq, computed, num_new))
            budget -= num_new
            i += 1

        if solo is not None and not preempted and solo.status is not SequenceStatus.RUNNING:
            if self._admit_solo(solo, budget, work) is None:
                self.suspects.clear()  # it cannot run alone beside what holds the pool: no more isolation
        elif solo is None and not preempted:
            self._admit_waiting(budget, work, preempted)

        if solo is not None and not work:
            self.suspects.clear()  # the suspect cannot run alone now: no more isolation
        scheduled = []
        for seq, computed, num_new in work:
            req = seq.request
            end = computed + num_new
            scheduled.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=req.all_token_ids[computed:end],
                    num_computed_tokens=computed,
                    block_ids=kv.get_block_ids(req.request_id),
                    sample=end == req.num_tokens,
                    sampling=seq.sampling,
                    num_output_tokens=req.num_output_tokens,
                    all_token_ids=req.all_token_ids,  # a reference, not a copy (the penalties read it)
                    num_prompt_tokens=req.num_prompt_tokens,
                )
            )
            req.num_computed_tokens = end
        output = SchedulerOutput(
            step=self.step_count,
            scheduled=tuple(scheduled),
            finished_request_ids=tuple(self._finished_since_last),
            preempted_request_ids=tuple(s.request_id for s in preempted),
        )
        self._finished_since_last = []
        self.step_count += 1
        return output

    def _admit_waiting(self, budget: int, work: list, preempted: list) -> None:
        """Step 2 of the module docstring: admit waiting requests while budget, slots and
        blocks allow (the next one :meth:`_pick`'s; with share keys, room made first by
        :meth:`_make_room`, before anything is admitted)."""
        kv = self.kv
        full_prompt = self.config.admission == "full_prompt"
        shares = self._share_counts()
        if shares is not None:
            budget += self._make_room(shares, work, preempted)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._pick(shares)
            req = seq.request
            hit_blocks, num_hit = self._prefix_hit(seq)
            num_new = kv.align_num_new_tokens(req, num_hit, min(req.num_tokens - num_hit, budget),
                                              self.config.max_num_batched_tokens)
            if num_new == 0:  # its chunk cannot reach a state checkpoint this step: it waits
                break
            fits = not full_prompt or self.blocks_to_admit(req, hit_blocks, num_hit) <= kv.num_free_blocks
            if not fits or kv.allocate_slots(req, num_new, num_hit, hit_blocks) is None:
                if kv.pins.unpin_last(keep=req.request_id):  # the queue's head goes before later pins
                    continue
                if not self.running:
                    raise PoolTooSmallError(
                        f"request {req.request_id!r} does not fit an otherwise empty pool of "
                        f"{self._usable_blocks} blocks"
                    )
                break
            self._take_waiting(seq)
            self._admitted(seq, num_hit, num_new, work)
            if shares is not None:
                shares[share_of(seq)] += 1
            budget -= num_new

    def _prefix_hit(self, seq: Sequence) -> tuple[KVCacheBlocks | None, int]:
        """The waiting ``seq``'s prefix hit; none for a request that scores its prompt
        (``SamplingParams.prompt_logprobs``: every prompt position is computed, as vLLM)."""
        if seq.sampling.prompt_logprobs is not None:
            return None, 0
        return self.kv.get_computed_blocks(seq.request)

    def _admitted(self, seq: Sequence, num_hit: int, num_new: int, work: list) -> None:
        """``seq``, out of the waiting queue and holding its slots, starts running."""
        self.kv.pins.unpin(seq.request_id)  # it holds its hit itself now
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        seq.admitted_step = self.step_count
        if not seq.num_preemptions:
            seq.num_cached_tokens = num_hit
        seq.last_hit_tokens = num_hit
        seq.request.num_computed_tokens = num_hit
        work.append((seq, num_hit, num_new))

    def _refresh_waiting(self) -> None:
        """The cached prefixes the first ``REFRESH_WAITING`` waiting requests will hit, marked
        as just used again, the queue's head last (so evicted last): blocks freed since a
        request arrived (finished requests') go before its hit. Reorders free blocks only."""
        for seq in reversed(list(itertools.islice(self.waiting, REFRESH_WAITING))):
            self.kv.refresh_prefix_hit(seq.request)

    def _preempt(self, seq: Sequence, count: bool = True) -> None:
        self.kv.free(seq.request)
        seq.request.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += count
        self.waiting.appendleft(seq)

    def blocks_to_admit(self, request: Request, hit_blocks: KVCacheBlocks | None = None, num_hit: int = 0) -> int:
        """Free blocks a waiting request (holding none) needs to be admitted under
        ``"full_prompt"``: the KV cache manager's full-prompt count
        (:meth:`~hybridkv.core.kv_cache_manager.KVCacheManager.num_blocks_to_admit`) at this
        scheduler's budget, for all its tokens (a preempted request's outputs too)."""
        num_tokens = min(request.num_tokens, self.config.max_model_len)
        return self.kv.num_blocks_to_admit(
            request, num_tokens, hit_blocks, num_hit, max_num_batched_tokens=self.config.max_num_batched_tokens
        )

    # --------------------------------------------------------------- results
    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int], failed: Collection[str] = ()
    ) -> list[Sequence]:
        """Append sampled tokens; finish and free requests that are done. Returns them.

        ``failed``: requests of the step whose row the model got wrong (a model fault: no
        token); each ends with ``FinishReason.ERROR``, its blocks of this step uncached
        first (their K/V is suspect). A suspect that sampled has run alone: it is cleared."""
        finished: list[Sequence] = []
        max_len = self.config.max_model_len
        for sr in output.scheduled:
            seq = self.sequences.get(sr.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or preempted since
            if failed and sr.request_id in failed:
                self._fail(seq, sr.num_computed_tokens)
                finished.append(seq)
                continue
            if not sr.sample:
                continue
            self.suspects.pop(sr.request_id, None)
            try:
                token = sampled[sr.request_id]
            except KeyError:
                raise InvalidArgumentError(f"the runner returned no token for {sr.request_id!r}") from None
            req = seq.request
            req.append_token_ids(token)
            if seq.first_token_step is None:
                seq.first_token_step = output.step
            sp = seq.sampling
            if token in sp.stop_token_ids:
                reason = FinishReason.STOP
            elif req.num_output_tokens >= sp.max_tokens or req.num_tokens >= max_len:
                reason = FinishReason.LENGTH
            else:
                continue
            self.kv.free(req)
            self._finish(seq, reason)
            finished.append(seq)
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
        return finished

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.suspects.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_step = self.step_count
        self.num_keyed -= seq.share_key is not None
        self._finished_since_last.append(seq.request_id)
        del self.sequences[seq.request_id]

    def step(self, runner: ModelRunner) -> tuple[SchedulerOutput, list[Sequence]]:
        """schedule → runner.execute → update_from_output."""
        output = self.schedule()
        sampled = runner.execute(output) if output.scheduled else {}
        return output, self.update_from_output(output, sampled)

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Queues and KV cache agree: running requests hold blocks, waiting ones none."""
        running_ids = [s.request_id for s in self.running]
        waiting_ids = [s.request_id for s in self.waiting]
        if len(set(running_ids)) != len(running_ids) or len(set(waiting_ids)) != len(waiting_ids):
            raise InvariantViolation("a request is twice in one queue")
        if set(running_ids) & set(waiting_ids):
            raise InvariantViolation(f"requests both waiting and running: {set(running_ids) & set(waiting_ids)}")
        if set(running_ids) | set(waiting_ids) != set(self.sequences):
            raise InvariantViolation("the queues and the request table disagree")
        if len(self.running) > self.config.max_num_seqs:
            raise InvariantViolation(f"{len(self.running)} running > max_num_seqs {self.config.max_num_seqs}")
        for seq in self.running:
            if seq.status is not SequenceStatus.RUNNING or not self.kv.has_request(seq.request_id):
                raise InvariantViolation(f"running {seq} holds no blocks")
        if self.num_keyed != sum(s.share_key is not None for s in self.sequences.values()):
            raise InvariantViolation(f"num_keyed {self.num_keyed} disagrees with the sequences' share keys")
        if any(rid not in self.sequences for rid in self.suspects):
            raise InvariantViolation("a suspect of a failed step is neither waiting nor running")
        waiting = set(waiting_ids)
        if any(rid not in waiting for rid in self.kv.pins):
            raise InvariantViolation("a pinned prefix hit belongs to no waiting request")
        for seq in self.waiting:
            if seq.status not in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED) or self.kv.has_request(seq.request_id):
                raise InvariantViolation(f"waiting {seq} holds blocks")
            if seq.request.num_computed_tokens != 0:
                raise InvariantViolation(f"waiting {seq} has computed tokens")
        self.kv.check_invariants()
