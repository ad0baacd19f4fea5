"""``bench_serve.py --noisy-neighbour``: a well-behaved client's stream with and without a hostile one.

    python3 benchmarks/bench_serve.py --noisy-neighbour [--quick] [--model NAME] [--rounds N]
                                      [--hostile slots,bodies] [--body-rate 40] [--threads N]

One ``hybridkv serve`` (SmolLM2-135M, 64 running slots by default, as the issue's report);
the well-behaved client streams a short completion (``--max-tokens``, default 16) three times
in a row and records each TTFT (request sent to its first chunk) and the gaps between its
chunks. Per round and hostile kind, it does so alone and beside the hostile client, the
order alternating round by round, and prints per kind the TTFT p50 and the inter-token
p99 of the two (all rounds pooled) and their ratios:

* ``slots``: two completions of ``max_num_seqs`` prompts each (60 new tokens, ignore_eos),
  one more sent as each ends, ask for every running slot; the well-behaved stream starts
  once their first tokens arrive (the hostile requests are closed after it: the server
  aborts them).
* ``bodies``: a thread posts 8 MB bodies of token ids back to back, ``--body-rate`` a
  second at most (0: no pause), each refused with 413 while it arrives.

The step of the running batch (the longest gap between the hostile stream's bursts) is
printed beside ``slots``: a stream arriving mid-step waits for that step, then for the
one that runs its prefill.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.support.noisy import Barrage, hostile_stream, ids_body, pct, step_gaps, stream_once

__all__ = ["run_noisy"]

HOSTILE_KINDS = ("slots", "bodies")


async def _well_behaved(base_url: str, body: dict, n: int = 3) -> list:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        return [await stream_once(client, body) for _ in range(n)]


async def _beside_slots(base_url: str, body: dict, hostile: dict) -> tuple[list, list[float]]:
    """The well-behaved streams beside two hostile requests kept going; (their times, the steps seen)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=8)) as client:
        started = asyncio.Event()
        stop = asyncio.Event()
        chunks: list[float] = []

        async def keep_going():
            while not stop.is_set():
                await hostile_stream(client, hostile, started, chunks)

        tasks = [asyncio.create_task(keep_going()) for _ in range(2)]
        await started.wait()
        runs = [await stream_once(client, body) for _ in range(3)]
        stop.set()
        for t in tasks:
            t.cancel()  # the client leaves: the server aborts what is left of them
        await asyncio.gather(*tasks, return_exceptions=True)
    return runs, step_gaps(sorted(chunks))


def run_noisy(server, model: str, max_num_seqs: int, rounds: int, max_tokens: int, kinds: list[str],
              body_rate: float) -> None:
    body = {"model": model, "prompt": "The history of Rome", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    hostile = {"model": model, "prompt": [f"Item {i}: a story about" for i in range(max_num_seqs)],
               "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    big = ids_body(model, 8_000_000)
    asyncio.run(_well_behaved(server.base_url, body, 1))  # warm
    alone: dict[str, list] = {k: [] for k in kinds}
    loaded: dict[str, list] = {k: [] for k in kinds}
    steps: list[float] = []
    refused = sent = 0
    for r in range(rounds):
        for kind in kinds:
            for with_hostile in ((False, True) if r % 2 == 0 else (True, False)):
                if not with_hostile:
                    alone[kind] += asyncio.run(_well_behaved(server.base_url, body))
                elif kind == "slots":
                    runs, seen = asyncio.run(_beside_slots(server.base_url, body, hostile))
                    loaded[kind] += runs
                    steps += seen
                else:
                    with Barrage(server.base_url, big, rate=body_rate or None) as barrage:
                        time.sleep(0.3)
                        loaded[kind] += asyncio.run(_well_behaved(server.base_url, body))
                    sent += barrage.sent
                    refused += sum(s == 413 for s in barrage.statuses)
        print(f"round {r + 1}/{rounds} done", flush=True)
    print(f"\nwell-behaved stream: {max_tokens} tokens, 3 per measurement, {rounds} rounds "
          f"(alone and beside the hostile client, alternating)")
    print(f"{'hostile client':<28} {'TTFT p50 alone':>15} {'beside':>9} {'ratio':>7}   "
          f"{'ITL p99 alone':>14} {'beside':>9} {'ratio':>7}")
    for kind in kinds:
        a_ttft = pct([x.ttft for x in alone[kind]], 0.5)
        l_ttft = pct([x.ttft for x in loaded[kind]], 0.5)
        a_itl = pct([g for x in alone[kind] for g in x.gaps], 0.99)
        l_itl = pct([g for x in loaded[kind] for g in x.gaps], 0.99)
        label = (f"2 x {max_num_seqs}-prompt requests" if kind == "slots"
                 else f"8 MB bodies, {body_rate:g}/s" if body_rate else "8 MB bodies, back to back")
        print(f"{label:<28} {a_ttft * 1000:>12.0f} ms {l_ttft * 1000:>6.0f} ms {l_ttft / a_ttft:>6.2f}x   "
              f"{a_itl * 1000:>11.1f} ms {l_itl * 1000:>6.1f} ms {l_itl / a_itl:>6.2f}x")
    if "slots" in kinds and steps:
        ttft = pct([x.ttft for x in loaded["slots"]], 0.5)
        print(f"step of the running batch beside the {max_num_seqs}-prompt requests (gaps between the hostile "
              f"stream's bursts): p50 {pct(steps, 0.5) * 1000:.0f} ms, max {max(steps) * 1000:.0f} ms; the "
              f"well-behaved TTFT p50 beside them is {ttft / pct(steps, 0.5):.2f} steps (the step in flight, then "
              f"the one that runs its prefill)")
    if "bodies" in kinds:
        print(f"bodies sent {sent}, answered 413 before their end {refused} (the rest: reset after the 413)")
