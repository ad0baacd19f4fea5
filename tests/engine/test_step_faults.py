"""One request's failure stays its own (fault injection into the real engine vs transformers).

A model run that raises on a chosen request, from a random step of it on (prefill or
decode), before the model wrote anything or after it wrote every K/V of the step, with
prefix hits and preemptions in flight (a tight pool, ``first_chunk`` admission): that
request ends with ``"error"``, every other request's greedy tokens equal transformers',
and a request arriving afterwards with the failed prompt (the fault gone) gets
transformers' tokens too. A step that fails once for no request in particular (a
transient fault) ends nobody. A row whose logits are ``nan`` ends that request alone with
no rollback. After every step the invariants hold and every block no request holds and
no prefix-cache entry names is filled with NaN, so a hit on a block whose K/V the failed
step never wrote would poison the logits (and end an innocent request with "error").
"""

from __future__ import annotations

import random

import pytest
import torch
from tests.support.hf_tiny import hf_generate

from hybridkv.engine.engine import NOT_NUMBERS, EngineConfig, LLMEngine
from hybridkv.scheduler import SamplingParams

NEW = 10


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    system = torch.randint(0, 128, (30,), generator=g).tolist()
    return {
        "A": system + torch.randint(0, 128, (7,), generator=g).tolist(),
        "B": system + torch.randint(0, 128, (4,), generator=g).tolist(),
        "C": torch.randint(0, 128, (41,), generator=g).tolist(),
        "D": system + [5, 6, 7],
    }


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def refs(tiny_models):
    cache: dict = {}

    def get(arch):
        if arch not in cache:
            path, hf = tiny_models(arch)
            cache[arch] = (path, {k: hf_generate(hf, p, NEW)[0] for k, p in PROMPTS.items()})
        return cache[arch]

    return get


class InjectedFault(RuntimeError):
    pass


class Faults:
    """Wraps the runner's ``execute``: raises on steps that run ``culprit`` from its
    ``from_step``-th scheduled step on (``before`` or ``after`` the real run), or once on the
    ``transient``-th step of several requests."""

    def __init__(self, engine: LLMEngine, culprit: str | None, from_step: int, after: bool,
                 transient: int | None = None) -> None:
        self.real = engine.runner.execute
        self.culprit, self.from_step, self.after, self.transient = culprit, from_step, after, transient
        self.seen = 0  # steps that scheduled the culprit
        self.multi = 0  # steps of several requests
        self.raised = 0
        self.on = True
        engine.runner.execute = self

    def __call__(self, output):
        ids = [sr.request_id for sr in output.scheduled]
        fail = False
        if self.on and self.culprit in ids:
            self.seen += 1
            fail = self.seen >= self.from_step
        if self.on and self.transient is not None and len(ids) > 1:
            self.multi += 1
            fail = fail or self.multi == self.transient
        if fail and not self.after:
            self.raised += 1
            raise InjectedFault(f"injected before the model ran {ids}")
        result = self.real(output)
        if fail:
            self.raised += 1
            raise InjectedFault(f"injected after the model ran {ids}")
        return result


def _poison_free_blocks(engine: LLMEngine) -> None:
    keep = {0}
    for seq in engine.scheduler.running:
        for table in engine.kv.get_block_ids(seq.request_id):
            keep.update(table)
    for block in engine.kv.pool.blocks:
        if block.block_hash is not None:
            keep.update(b.block_id for b in (block.stripe or (block,)))
    engine.storage.fill_blocks(sorted(set(range(engine.storage.num_blocks)) - keep), float("nan"))


def _drive(engine: LLMEngine, arrivals: dict[int, list[str]], prefix: str = "") -> dict:
    outputs = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for name in arrivals.get(step, []):
            engine.add_request(PROMPTS[name], SamplingParams(max_tokens=NEW), request_id=prefix + name)
        if engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
            engine.scheduler.check_invariants()
            _poison_free_blocks(engine)
        step += 1
        assert step < 2000
    return outputs


def _engine(path, tight: bool) -> LLMEngine:
    cfg = dict(block_size=4, max_num_batched_tokens=16, max_model_len=128, admission="first_chunk")
    probe = LLMEngine(path, EngineConfig(num_blocks=2000, **cfg))
    peak = probe.scheduler.peak_blocks(max(map(len, PROMPTS.values())) + NEW)
    engine = LLMEngine(path, EngineConfig(num_blocks=peak + 5 if tight else 400, **cfg))
    engine.storage.fill_blocks(list(range(engine.storage.num_blocks)), float("nan"))
    return engine


def _check_whole(engine: LLMEngine) -> None:
    engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests() and not engine.scheduler.suspects
    assert engine.kv.num_free_blocks == engine.kv.usable_blocks


ARCHS = ["gemma3", "llama4_dense", "llama"]
FAST = [(a, s) for a in ARCHS for s in range(2)]
SLOW = [pytest.param(a, s, marks=pytest.mark.slow) for a in ARCHS for s in range(2, 8)]


@pytest.mark.parametrize("arch,seed", FAST + SLOW)
def test_a_request_the_model_fails_on_ends_alone(arch, seed, refs):
    path, want = refs(arch)
    rng = random.Random(f"{arch}-{seed}")
    culprit = rng.choice(sorted(PROMPTS))
    tight = rng.random() < 0.6
    engine = _engine(path, tight)
    # its first scheduled step is a prefill chunk, its last few decodes: anywhere in between
    faults = Faults(engine, culprit, from_step=rng.randint(1, NEW - 1), after=rng.random() < 0.5)
    arrivals = {0: ["A", "C"]}
    for name, latest in (("B", 6), ("D", 12)):  # while the others run: B and D hit A's system prompt
        arrivals.setdefault(rng.randint(1, latest), []).append(name)
    outputs = _drive(engine, arrivals)
    assert set(outputs) == set(PROMPTS) and faults.raised >= 1
    for name, out in outputs.items():
        if name == culprit:
            assert out.finish_reason == "error" and "InjectedFault" in out.error
            assert list(out.output_token_ids) == want[name][: len(out.output_token_ids)]
        else:
            assert out.finish_reason == "length" and out.error is None, (name, out)
            assert list(out.output_token_ids) == want[name], f"{name}: tokens differ from HF"
    _check_whole(engine)
    if tight:
        assert engine.scheduler.num_preemptions + engine.scheduler.num_rolled_back_steps > 0
    # the same prompts again, the fault gone: cached prefixes (the failed one's too) are right
    faults.on = False
    again = _drive(engine, {0: sorted(PROMPTS)}, prefix="again-")
    for name in PROMPTS:
        assert list(again["again-" + name].output_token_ids) == want[name], f"{name} again: tokens differ from HF"
    _check_whole(engine)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_transient_step_fault_ends_nobody(arch, refs):
    path, want = refs(arch)
    engine = _engine(path, tight=False)
    faults = Faults(engine, None, from_step=0, after=True, transient=3)
    outputs = _drive(engine, {0: ["A", "B", "C"], 2: ["D"]})
    assert faults.raised == 1 and engine.scheduler.num_rolled_back_steps == 1
    for name, out in outputs.items():
        assert out.finish_reason == "length" and list(out.output_token_ids) == want[name], name
    _check_whole(engine)


def test_nan_logits_end_their_request_alone_without_a_rollback(refs):
    path, want = refs("gemma3")
    engine = _engine(path, tight=False)
    real = engine.runner._sample
    state = {"n": 0}

    def poisoned(reqs, sampled, logits):
        rows = [reqs[i].request_id for i in sampled]
        if "C" in rows and len(rows) > 1:
            state["n"] += 1
            if state["n"] == 3:
                logits = logits.clone()
                logits[rows.index("C")] = float("nan")
        return real(reqs, sampled, logits)

    engine.runner._sample = poisoned
    outputs = _drive(engine, {0: ["A", "B", "C", "D"]})
    assert outputs["C"].finish_reason == "error" and outputs["C"].error == NOT_NUMBERS
    assert engine.scheduler.num_rolled_back_steps == 0
    for name in "ABD":
        assert list(outputs[name].output_token_ids) == want[name], name
    _check_whole(engine)
    engine.runner._sample = real
    again = _drive(engine, {0: ["C"]}, prefix="again-")
    assert list(again["again-C"].output_token_ids) == want["C"]
