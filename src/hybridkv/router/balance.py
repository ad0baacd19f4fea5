"""The balance rule: recent routing shares, so that cache hits cannot drift the load apart.

Hits reinforce themselves: the replica that holds a system prompt gets its new chats, which
keep the prompt there, and a replica that lost it gets none of them again. The in-flight
rule (``max_imbalance``) sees only the requests running now, a few per replica under a
closed-loop client, so it never notices when, over hundreds of requests, one replica
receives a sixth of them and the others the rest (what ``bench_route`` showed at 768
blocks: the loaded replicas evict more, and the exact-hit policies fell below full-only).

SGLang's cache-aware router switches to shortest-queue while the system is imbalanced
(``max - min > abs`` and ``max > rel * min`` over queue lengths). Ours applies the relative
test to each replica's share of the recent decisions (an exponentially decaying count over
about ``window`` decisions): a replica whose share exceeds ``max_share_ratio`` times the
least-served replica's is passed over for hits; among the others the largest hit still
wins. The least-served replica is never passed over, so neither is every replica; a
replica that received little lately (starved by hits elsewhere) takes the requests whose best
hit is elsewhere until its share is within the ratio again; one that comes back up starts at
the least share of the others (not at the share that decayed while it was down). A ratio of 1
sends each request to the least-served replica: hits then only break ties. Capping the
largest share alone is not enough: with 3 replicas and a cap of 1.25x the fair share, one
replica may still fall to half of it.

Worked example (``window`` 64, ``max_share_ratio`` 1.5, 3 replicas): after 60 decisions,
27 of them to r0, 18 to r1 and 15 to r2, the shares are about 0.45, 0.30, 0.25: the limit is
1.5 x 0.25 = 0.375, so r0 is passed over and the request goes to the better hit of r1 and
r2, even if r0 holds a longer one; once r0's share is within 1.5x r2's, hits rank all
three again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hybridkv.errors import InvalidConfigError

__all__ = ["Balance", "RecentShares", "DEFAULT_MAX_SHARE_RATIO", "DEFAULT_SHARE_WINDOW"]

DEFAULT_MAX_SHARE_RATIO = 1.5
DEFAULT_SHARE_WINDOW = 64
#: bounds that keep the arithmetic finite (a ratio of 1e6 is as good as no rule)
MAX_RATIO = 1e6
MAX_WINDOW = 1_000_000


@dataclass(frozen=True, slots=True)
class Balance:
    """``max_share_ratio``: a replica whose share of the recent decisions exceeds this multiple
    of the least-served replica's is passed over for hits (``None``: no rule); ``window``: about
    how many decisions the shares remember (each decision weighs ``1 - 1 / window`` of the one
    before)."""

    max_share_ratio: float | None = DEFAULT_MAX_SHARE_RATIO
    window: int = DEFAULT_SHARE_WINDOW

    def __post_init__(self) -> None:
        m = self.max_share_ratio
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 1.0 <= m <= MAX_RATIO):
            raise InvalidConfigError(
                f"max_share_ratio must be a number in [1, {MAX_RATIO:g}] (a multiple of the least share), got {m!r:.40}"
            )
        w = self.window
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_WINDOW:
            raise InvalidConfigError(
                f"the balance window must be an int in [1, {MAX_WINDOW:,}] decisions, got {w!r:.40}"
            )


class RecentShares:
    """Exponentially decaying decision counts per replica name (see the module docstring)."""

    def __init__(self, balance: Balance) -> None:
        self.balance = balance
        self._decay = 1.0 - 1.0 / balance.window
        self._counts: dict[str, float] = {}
        self._total = 0.0
        self._up: frozenset[str] = frozenset()  # the replicas up at the last decision

    def record(self, name: str) -> None:
        """One decision went to ``name``."""
        d = self._decay
        for k in self._counts:
            self._counts[k] *= d
        self._counts[name] = self._counts.get(name, 0.0) + 1.0
        self._total = self._total * d + 1.0

    def share(self, name: str) -> float:
        """``name``'s share of the recent decisions (0 before any)."""
        return self._counts.get(name, 0.0) / self._total if self._total else 0.0

    def over(self, names: Sequence[str]) -> set[str]:
        """Those of ``names`` (the replicas up now) whose share exceeds ``max_share_ratio`` times
        the least share among them; never the least served, so never all.

        A replica that was not up at the last decision (back from down, or added) starts at the
        least count of those that were: its decisions decayed while it was away, and the rule
        would otherwise send it every request, hits or not, until it caught up.
        """
        up = frozenset(names)
        back = up - self._up
        if back and self._up & up:
            floor = min(self._counts.get(n, 0.0) for n in self._up & up)
            for n in back:
                self._counts[n] = max(self._counts.get(n, 0.0), floor)
            self._total = sum(self._counts.values())
        self._up = up
        limit = self.balance.max_share_ratio
        if limit is None or len(names) < 2 or self._total <= 0.0:
            return set()
        counts = [self._counts.get(n, 0.0) for n in names]
        cap = limit * min(counts)
        return {n for n, c in zip(names, counts) if c > cap}
