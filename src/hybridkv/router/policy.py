"""How the router picks a replica: five policies behind one method.

    policy = make_policy("hybrid", max_imbalance=8)
    replica, predicted_hit = await policy.choose(token_ids, candidates)

| name           | hit it ranks by                                                    |
|----------------|--------------------------------------------------------------------|
| round-robin    | none: replicas in turn                                             |
| least-loaded   | none: fewest requests in flight (the router's own count)           |
| full-only      | the index's hit counting only full-attention groups (what routers  |
|                | that drop sliding / chunked groups predict)                        |
| hybrid         | the index's hit valid for every group (the core's rules)           |
| oracle         | each replica's own manager, asked over HTTP (``/kv_cache/peek``)   |

The hit-ranking policies share one rule (:func:`pick`): among replicas whose in-flight
count is at most the least loaded one's plus ``max_imbalance``, and whose share of the
recent decisions is within ``max_share_ratio`` times the least-served replica's
(:mod:`~hybridkv.router.balance`),
take the largest hit; ties go to the less loaded, then in turn. So a cache hit wins unless
following it would pile more than ``max_imbalance`` requests onto one replica beyond the
least loaded, or keep sending one replica more than its share of the traffic.

``hybrid`` breaks ties in hit by the full-attention groups' hit first: among replicas
that offer the same hit, the one still holding the conversation's chain (though the
windows a longer hit needs were evicted) keeps the chat, rather than the least loaded
one. Moving costs this request nothing (both recompute the same tokens) but leaves the
old chain behind as dead weight and makes the new replica store the whole conversation
again.
Without token ids (no tokenizer, an unparsable body) every hit is 0 and the rule is
least-loaded.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from typing import Awaitable, Callable, Collection, Protocol, Sequence

from hybridkv.errors import InvalidConfigError
from hybridkv.router.balance import Balance, RecentShares
from hybridkv.router.replica import Replica

__all__ = ["Policy", "PolicyName", "make_policy", "pick", "DEFAULT_MAX_IMBALANCE"]

#: a hit may put at most this many more in-flight requests on a replica than on the least loaded
#: (``route --max-imbalance``); the share rule (:mod:`~hybridkv.router.balance`) keeps the longer-run
#: balance, so this only bounds bursts
DEFAULT_MAX_IMBALANCE = 8

log = logging.getLogger("hybridkv.router")


class PolicyName(str, enum.Enum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    FULL_ONLY = "full-only"
    HYBRID = "hybrid"
    ORACLE = "oracle"


class Policy(Protocol):
    name: PolicyName

    async def choose(self, token_ids: Sequence[int] | None, replicas: Sequence[Replica]) -> tuple[Replica, int]:
        """The replica for a request of ``token_ids`` (``replicas``: up, non-empty) and the hit
        tokens predicted there."""


def pick(replicas: Sequence[Replica], hits: Sequence[int], max_imbalance: int, turn: int,
         affinity: Callable[[int], int] | None = None, passed_over: Collection[str] = (),
         share: Callable[[str], float] | None = None) -> tuple[Replica, int]:
    """The module docstring's rule. ``affinity(i)`` (optional), asked only of the replicas
    that tie for the largest eligible hit, breaks that tie before load; ``passed_over``:
    names of replicas not eligible (over their share of recent decisions:
    :mod:`~hybridkv.router.balance`), unless that leaves none; ``share(name)`` (optional),
    that share, breaks ties in load (the smaller first); ``turn`` rotates among full ties."""
    least = min(r.in_flight for r in replicas)
    n = len(replicas)
    order = [i for i in ((turn + k) % n for k in range(n)) if replicas[i].in_flight <= least + max_imbalance]
    if passed_over:
        order = [i for i in order if replicas[i].name not in passed_over] or order
    top = max(hits[i] for i in order)
    tied = [i for i in order if hits[i] == top]
    ranked = {i: affinity(i) for i in tied} if affinity is not None and len(tied) > 1 else {}
    shares = {i: share(replicas[i].name) for i in tied} if share is not None and len(tied) > 1 else {}
    i = max(tied, key=lambda i: (ranked.get(i, 0), -replicas[i].in_flight, -shares.get(i, 0.0)))  # equals: in turn
    return replicas[i], hits[i]


class _Ranked:
    """A policy that ranks by a per-replica hit (sync or async)."""

    def __init__(self, name: PolicyName, hit: Callable[[Replica, Sequence[int]], int | Awaitable[int]] | None,
                 max_imbalance: int, affinity: Callable[[Replica, Sequence[int]], int] | None = None,
                 balance: Balance | None = None) -> None:
        self.name = name
        self._hit = hit
        self._affinity = affinity
        self.max_imbalance = max_imbalance
        self._turn = itertools.count()
        #: recent decisions per replica (None: hits rank every replica within ``max_imbalance``)
        self.shares = RecentShares(balance) if balance is not None and balance.max_share_ratio is not None else None

    async def choose(self, token_ids, replicas):
        turn = next(self._turn)
        affinity = None
        if self._hit is None or token_ids is None or not len(token_ids):
            hits = [0] * len(replicas)
        else:
            values = [self._hit(r, token_ids) for r in replicas]
            if values and asyncio.iscoroutine(values[0]):
                values = await asyncio.gather(*values)
            hits = list(values)
            if self._affinity is not None:
                affinity = lambda i: self._affinity(replicas[i], token_ids)  # noqa: E731
        shares = self.shares
        over = shares.over([r.name for r in replicas]) if shares is not None else ()
        replica, hit = pick(replicas, hits, self.max_imbalance, turn, affinity, over,
                            shares.share if shares is not None else None)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("routed to %s: hits %s, in flight %s, passed over %s", replica.name,
                      {r.name: h for r, h in zip(replicas, hits)}, {r.name: r.in_flight for r in replicas},
                      sorted(over))
        if shares is not None:
            shares.record(replica.name)
        return replica, hit


class _RoundRobin:
    name = PolicyName.ROUND_ROBIN

    def __init__(self) -> None:
        self._turn = itertools.count()

    async def choose(self, token_ids, replicas):
        return replicas[next(self._turn) % len(replicas)], 0


def make_policy(name: str, *, max_imbalance: int = DEFAULT_MAX_IMBALANCE, balance: Balance | None = Balance(),
                oracle: Callable[[Replica, Sequence[int]], Awaitable[int]] | None = None) -> Policy:
    """The policy called ``name``; ``balance``: the share rule of the hit-ranking policies
    (None: none); ``oracle`` asks a replica for its hit (the oracle policy)."""
    try:
        kind = PolicyName(name)
    except ValueError:
        raise InvalidConfigError(f"unknown policy {name!r}; expected one of {[p.value for p in PolicyName]}") from None
    if isinstance(max_imbalance, bool) or not isinstance(max_imbalance, int) or max_imbalance < 0:
        raise InvalidConfigError(f"max_imbalance must be an int >= 0, got {max_imbalance!r}")
    if balance is not None and not isinstance(balance, Balance):
        raise InvalidConfigError(f"balance must be a Balance or None, got {balance!r}")
    if kind is PolicyName.ROUND_ROBIN:
        return _RoundRobin()
    if kind is PolicyName.LEAST_LOADED:
        return _Ranked(kind, None, 0)
    if kind is PolicyName.FULL_ONLY:
        return _Ranked(kind, Replica.score_full_only, max_imbalance, balance=balance)
    if kind is PolicyName.HYBRID:
        return _Ranked(kind, Replica.score, max_imbalance, affinity=Replica.score_full_only, balance=balance)
    if oracle is None:
        raise InvalidConfigError("the oracle policy needs a way to ask replicas")
    return _Ranked(kind, oracle, max_imbalance, balance=balance)
