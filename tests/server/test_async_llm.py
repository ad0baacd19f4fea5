"""The engine thread under random traffic: submissions, clients that leave at random
moments, stop strings; outputs equal the offline engine's, nothing leaks."""

from __future__ import annotations

import asyncio
import random

import pytest
from tests.support.tiers import slow_except

from hybridkv.errors import PromptTooLongError, ServiceUnavailableError
from hybridkv.scheduler.interface import SamplingParams
from hybridkv.server import AsyncLLM

WORDS = ["hello", "world", "abc", "the", "fox", "Zebra", "42", "été", "мир"]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


@pytest.mark.parametrize("seed", slow_except(range(3), 0))
def test_random_traffic_matches_offline_and_frees_everything(tiny_llm, seed):
    rng = random.Random(seed)
    jobs = []
    for i in range(24):
        prompts = [_prompt(rng) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        sp = SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=rng.random() < 0.5)
        leave_after = rng.choice([None, None, None, 0, 1, 3])  # chunks read before the client leaves
        jobs.append((prompts, sp, leave_after, rng.random() * 0.05))
    offline = {i: tiny_llm.generate(p, sp) for i, (p, sp, leave, _) in enumerate(jobs) if leave is None}
    engine = tiny_llm.engine

    async def client(front, i, prompts, sp, leave_after, delay):
        await asyncio.sleep(delay)
        ids = [tiny_llm.encode(p) for p in prompts]
        sub = await front.submit(ids, [sp.with_eos(tiny_llm.eos_token_ids)] * len(ids))
        texts, finals, n = {}, {}, 0
        try:
            async for chunk in sub:
                texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
                if chunk.final is not None:
                    finals[chunk.index] = chunk.final
                n += 1
                if leave_after is not None and n > leave_after:
                    return None
        finally:
            sub.close()
        return [texts.get(k, "") for k in range(len(prompts))], [finals[k] for k in range(len(prompts))]

    async def main():
        front = AsyncLLM(tiny_llm, max_waiting=1000)
        front.start()
        results = await asyncio.wait_for(asyncio.gather(*(client(front, i, *job) for i, job in enumerate(jobs))), 120)
        assert await front.wait_idle(10)
        engine.kv.check_invariants()
        engine.scheduler.check_invariants()
        blocks = await front.shutdown()
        return results, blocks

    results, (free, usable) = asyncio.run(main())
    assert free == usable
    assert not engine.has_unfinished_requests()
    for i, expected in offline.items():
        texts, finals = results[i]
        assert texts == [o.text for o in expected]
        assert [f.token_ids for f in finals] == [o.token_ids for o in expected]
        assert [f.finish_reason for f in finals] == [o.finish_reason for o in expected]


def test_a_submission_is_added_whole_or_not_at_all(tiny_llm):
    async def main():
        front = AsyncLLM(tiny_llm, max_waiting=8)
        front.start()
        try:
            ok = tiny_llm.encode("hi")
            too_long = [5] * 300  # past max_model_len: refused at add, after the first was added
            with pytest.raises(PromptTooLongError):
                await front.submit([ok, too_long], [SamplingParams(max_tokens=2)] * 2)
            assert front.num_unfinished == 0 and not tiny_llm.engine.has_unfinished_requests()
            with pytest.raises(ServiceUnavailableError):
                await front.submit([ok] * 9, [SamplingParams(max_tokens=2)] * 9)
            sub = await front.submit([ok], [SamplingParams(max_tokens=2)])
            return [c async for c in sub]
        finally:
            await front.shutdown()

    chunks = asyncio.run(main())
    assert chunks[-1].final is not None and len(chunks[-1].final.token_ids) == 2


def test_a_steps_kv_events_are_published_before_its_model_step(tiny_dir):
    """The engine thread publishes a step's events once it is scheduled, before the model
    runs (a router sees evictions a model step sooner), and the events add up to all of
    the manager's."""
    from hybridkv.core.events import BlockStored
    from hybridkv.engine.llm import LLM

    from tests.support.tiny_server import engine_config

    llm = LLM(str(tiny_dir), engine_config(enable_kv_events=True, max_num_batched_tokens=8))
    order: list = []

    class Publisher:
        def publish(self, events):
            order.append(("publish", sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))))

        def close(self):
            pass

    runner = llm.engine.runner
    execute = runner.execute

    def traced(output):
        order.append(("execute", sum(len(sr.token_ids) for sr in output.scheduled)))
        return execute(output)

    runner.execute = traced

    async def main():
        front = AsyncLLM(llm, kv_publisher=Publisher())
        front.start()
        try:
            sub = await front.submit([list(range(3, 22))], [SamplingParams(max_tokens=3, ignore_eos=True)])
            return [c async for c in sub]
        finally:
            await front.shutdown()

    chunks = asyncio.run(main())
    assert chunks[-1].final is not None
    # 19 prompt tokens in chunks of 8 (blocks of 4), then decodes: a step's blocks are
    # cached when it is scheduled, and published then, between scheduling and the model
    groups = len(llm.engine.grouping.groups)
    assert order[:2] == [("publish", 2 * groups), ("execute", 8)]
    publishes = [i for i, (kind, _) in enumerate(order) if kind == "publish"]
    assert all(order[i + 1][0] == "execute" for i in publishes), order
    stored = sum(n for kind, n in order if kind == "publish")
    assert stored == groups * ((19 + 2) // 4)  # every full block of the 21 computed tokens, in every group
