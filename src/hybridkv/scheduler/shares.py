"""Fair shares of running slots for :class:`~hybridkv.scheduler.scheduler.Scheduler`.

A request may carry a *share key* (``add_request(..., share_key=...)``): the prompts of
one HTTP request (a list of prompts, ``n`` samples) or one client's requests carry the
same key. Sequences with no key are each their own share. When any unfinished sequence
has a key, admission favours the keys running fewest instead of first come, first served:

* **pick**: the next waiting sequence to admit is the first, in queue order (preempted
  ones first, as before), of those whose key has the fewest running sequences. A
  stream arriving behind 60 queued prompts of another request is admitted first.
* **make room**: at the start of admission, before anything is admitted, one slot is
  made for each waiting key that runs nothing, beyond the free slots: the most recently
  admitted running sequence of the key running the most is preempted, while that key
  runs two or more (recomputed later: nothing is lost; if this step had scheduled it, its
  tokens go back to the budget and the blocks its allocation addressed lose their
  address, as they will not be written). Before anything is admitted, because a sequence
  admitted in this step could hit those blocks. So every key gets its first slot at the
  next step, at the cost of one preemption; further slots go to the key running fewest
  as running sequences finish. Evening out more by preemption (a second 64-prompt
  request taking 32 slots from the first at once) would recompute 32 sequences in one
  step and make that step, the one a newcomer's first token waits for, several times
  longer. Room is made in slots only: a newcomer the pool cannot hold waits for blocks
  as any request does.

Why not a cap per request (``--max-seqs-per-request``): a cap idles slots when the
capped request is alone, and still lets several capped requests fill the batch; fair
admission keeps a lone 64-prompt request at full batch and gives a newcomer a slot at
the next step. With no keys (every sequence its own share, the offline ``LLM`` and the
bare scheduler) every waiting sequence's key runs nothing and every running one's runs
one, so *pick* is the queue's head and *make room* never fires: scheduling is vLLM's,
decision by decision.

Example (``max_num_seqs`` 4): request R (key ``r``) has prompts r0..r5; r0..r3 run,
r4 and r5 wait. Stream S (key ``s``) arrives. Next step: ``s`` runs nothing, no slot is
free and ``r`` runs two or more, so r3 (admitted last) is preempted to the queue's front;
*pick* S (``s`` runs 0, ``r`` 3): S is admitted. Then r3 is picked, but no slot is free:
it waits for one, as do r4 and r5 (``r`` runs something: no room is made for it).
"""

from __future__ import annotations

from collections import Counter

from hybridkv.scheduler.sequence import Sequence

__all__ = ["FairShare", "share_of"]


def share_of(seq: Sequence) -> str:
    """``seq``'s share key: its own, or its request id when it has none."""
    return seq.share_key if seq.share_key is not None else seq.request.request_id


class FairShare:
    """Mixed into the Scheduler, whose ``__init__`` sets the attributes used here (``running``,
    ``waiting``, ``kv``, ``config``, ``num_keyed``, ``num_share_preemptions``) and which has
    ``_preempt``."""

    __slots__ = ()

    def _share_counts(self) -> Counter | None:
        """Running sequences per share key, or None when no unfinished sequence has a key
        (FCFS: see the module docstring)."""
        if not self.num_keyed:
            return None
        return Counter(share_of(s) for s in self.running)

    def _pick(self, shares: Counter | None) -> Sequence:
        """The waiting sequence to admit next: the first of those whose key runs fewest."""
        head = self.waiting[0]
        if shares is None:
            return head
        best, chosen = shares[share_of(head)], head
        if best:
            for seq in self.waiting:
                count = shares[share_of(seq)]
                if count < best:
                    best, chosen = count, seq
                    if not count:
                        break
        return chosen

    def _take_waiting(self, seq: Sequence) -> None:
        """Remove the picked ``seq`` from the waiting queue."""
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)

    def _make_room(self, shares: Counter, work: list, preempted: list) -> int:
        """Preempt one running sequence for each waiting key that runs nothing, beyond the
        free slots, while the key running most runs two or more (see the module docstring;
        call before anything is admitted this step). The budget tokens that frees (the
        victims' tokens scheduled this step)."""
        newcomers = {share_of(s) for s in self.waiting if not shares[share_of(s)]}
        need = len(newcomers) - (self.config.max_num_seqs - len(self.running))
        freed = 0
        while need > 0 and self.running:
            top = max(shares.values())
            if top < 2:
                break
            victim = next(s for s in reversed(self.running) if shares[share_of(s)] == top)
            self.running.remove(victim)
            shares[share_of(victim)] -= 1
            for i, (scheduled, computed, num_new) in enumerate(work):
                if scheduled is victim:  # its slots were allocated this step, and full blocks' hashes cached:
                    del work[i]  # the step will not write them, so they lose their address first
                    self.kv.uncache_unwritten(victim.request, computed)
                    freed += num_new
                    break
            self._preempt(victim)
            self.num_share_preemptions += 1
            preempted.append(victim)
            need -= 1
        return freed
