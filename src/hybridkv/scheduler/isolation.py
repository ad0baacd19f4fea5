"""Fault isolation for :class:`~hybridkv.scheduler.scheduler.Scheduler`: one request's failure
stays its own.

A step whose model run raised is undone by :meth:`Scheduler.roll_back`: it had already
advanced the scheduled requests and cached their new blocks' hashes, so those blocks
lose their address (no prefix hit may read K/V that was never written) and the requests
are preempted (recomputed from what was written before). A step of one request that
fails ends that request with ``ERROR``; after a failed step of several, each of them is
a *suspect* and runs alone (one request per step, everything else waits) until a step
of it samples: the one whose solo step fails again is the cause, the others go on.

Example: A, B and C run in a step that raises (a kernel fails on C's positions). All three
lose the step's blocks' addresses and wait again, in order; the next step runs A alone
(recomputing it from its prefix hit) and samples: A is cleared; then B alone, cleared;
then C alone raises again: C ends with ``ERROR`` and the scheduler is back to normal,
with nothing lost but the recompute. A transient fault (no request's) clears all three.
"""

from __future__ import annotations

import itertools

from hybridkv.scheduler.interface import SchedulerOutput
from hybridkv.scheduler.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["FaultIsolation"]


class FaultIsolation:
    """Mixed into the Scheduler, whose ``__init__`` sets the attributes used here (``suspects``,
    ``running``, ``waiting``, ``sequences``, ``kv``, ``config``, ``num_rolled_back_steps``)."""

    __slots__ = ()

    def roll_back(self, output: SchedulerOutput) -> list[Sequence]:
        """Undo ``output`` (its model run raised; see the module docstring): each scheduled
        request still running loses the address of its blocks holding tokens the step
        computed, and is preempted (not counted in ``num_preemptions``) or, when it ran
        alone, ends with ``FinishReason.ERROR``. Returns the requests that ended."""
        live = [(self.sequences.get(sr.request_id), sr) for sr in output.scheduled]
        live = [(seq, sr) for seq, sr in live if seq is not None and seq.status is SequenceStatus.RUNNING]
        self.num_rolled_back_steps += 1
        if len(live) == 1:
            seq, sr = live[0]
            self._fail(seq, sr.num_computed_tokens)
            return [seq]
        for seq, sr in live:
            self.kv.uncache_unwritten(seq.request, sr.num_computed_tokens)
        order = {id(s): i for i, s in enumerate(self.running)}
        for seq, _ in sorted(live, key=lambda item: order[id(item[0])], reverse=True):
            self.running.remove(seq)
            self._preempt(seq, count=False)  # appended to the front: the queue keeps their order
        for seq, _ in live:
            self.suspects[seq.request_id] = None
        return []

    def _fail(self, seq: Sequence, num_written_tokens: int) -> None:
        """End the running ``seq`` with ``ERROR``: its unwritten blocks uncached, all freed."""
        self.kv.uncache_unwritten(seq.request, num_written_tokens)
        self.running.remove(seq)
        self.kv.free(seq.request)
        self._finish(seq, FinishReason.ERROR)

    def _next_suspect(self) -> Sequence | None:
        """The suspect to run alone this step: the running one, else the first waiting one."""
        for seq in itertools.chain(self.running, self.waiting):
            if seq.request_id in self.suspects:
                return seq
        self.suspects.clear()
        return None

    def _admit_solo(self, seq: Sequence, budget: int, work: list) -> int | None:
        """Admit the waiting suspect ``seq`` alone (out of queue order); its new tokens, or
        None when the pool cannot hold it now."""
        kv, req = self.kv, seq.request
        if len(self.running) >= self.config.max_num_seqs:
            return None
        hit_blocks, num_hit = self._prefix_hit(seq)
        num_new = kv.align_num_new_tokens(req, num_hit, min(req.num_tokens - num_hit, budget),
                                          self.config.max_num_batched_tokens)
        if num_new == 0:
            return None
        if self.config.admission == "full_prompt" and self.blocks_to_admit(req, hit_blocks, num_hit) > kv.num_free_blocks:
            return None
        if kv.allocate_slots(req, num_new, num_hit, hit_blocks) is None:
            return None
        self.waiting.remove(seq)
        self._admitted(seq, num_hit, num_new, work)
        return num_new
