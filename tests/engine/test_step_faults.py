"""One request's failure stays its own (fault injection into the real engine vs transformers).

A model run that raises on a chosen request, from a random step of it on (prefill or
decode), before the model wrote anything or after it wrote every K/V of the step, with
prefix hits and preemptions in flight (a tight pool, ``first_chunk`` admission): that
request ends with ``"error"``, every other request's greedy tokens equal transformers',
and requests arriving afterwards with every prompt, and with every prompt followed by its
output (the fault gone), get transformers' tokens too: no prefix hit or state checkpoint
reads what the failed step never wrote. A step that fails once for no request in particular (a
transient fault) ends nobody. A row whose logits are ``nan`` ends that request alone with
no rollback. After every step the invariants hold and every block no request holds and
no prefix-cache entry names is filled with NaN, so a hit on a block whose K/V the failed
step never wrote would poison the logits (and end an innocent request with "error").
"""

from __future__ import annotations

import random

import pytest
import torch
from tests.support.poison import poison_free_blocks
from tests.support.hf_tiny import hf_generate
from tests.support.qwen3_next_tiny import build_qwen3_next
from tests.support.tiers import slow_except

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


class Refs:
    """transformers' greedy tokens for each prompt, and for each prompt followed by its own
    greedy output (a request that hits the blocks and checkpoints of output positions)."""

    def __init__(self, path, hf) -> None:
        self.path, self.hf = path, hf
        self.want = {k: hf_generate(hf, p, NEW)[0] for k, p in PROMPTS.items()}
        self.extended = {k: p + self.want[k] for k, p in PROMPTS.items()}
        self.want_extended = {k: hf_generate(hf, p, NEW)[0] for k, p in self.extended.items()}

    def check_again(self, engine: LLMEngine) -> None:
        """Every prompt and every extended prompt again, the fault gone: cached prefixes and
        checkpoints (those of the failed request and steps too) give transformers' tokens."""
        again = _drive(engine, {0: sorted(PROMPTS)}, prefix="again-")
        ext = _drive(engine, {0: sorted(PROMPTS)}, prefix="ext-", prompts=self.extended)
        for name in PROMPTS:
            assert list(again["again-" + name].output_token_ids) == self.want[name], f"{name} again: differs from HF"
            assert list(ext["ext-" + name].output_token_ids) == self.want_extended[name], f"{name} extended: differs"
        _check_whole(engine)


@pytest.fixture(scope="module")
def refs(tiny_models):
    cache: dict = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = Refs(*tiny_models(arch))
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


def _drive(engine: LLMEngine, arrivals: dict[int, list[str]], prefix: str = "", prompts=PROMPTS) -> dict:
    outputs = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for name in arrivals.get(step, []):
            engine.add_request(prompts[name], SamplingParams(max_tokens=NEW), request_id=prefix + name)
        if engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
            engine.scheduler.check_invariants()
            poison_free_blocks(engine)
        step += 1
        assert step < 2000
    return outputs


def _engine(path, tight: bool, **extra) -> LLMEngine:
    cfg = dict(block_size=4, max_num_batched_tokens=16, max_model_len=128, admission="first_chunk", **extra)
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
FAST = [("gemma3", 0)]  # the fast tier; the full suite runs every arch on seeds 0..7
SLOW = [pytest.param(a, s, marks=pytest.mark.slow) for a in ARCHS for s in range(2) if (a, s) not in FAST]
SLOW += [pytest.param(a, s, marks=pytest.mark.slow) for a in ARCHS for s in range(2, 8)]


@pytest.mark.parametrize("arch,seed", FAST + SLOW)
def test_a_request_the_model_fails_on_ends_alone(arch, seed, refs):
    ref = refs(arch)
    path, want = ref.path, ref.want
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
    faults.on = False
    ref.check_again(engine)


@pytest.fixture(scope="module")
def state_refs(tmp_path_factory):
    """Qwen3-Next's tiny model (linear-attention layers: states updated in place by decodes)."""
    path = tmp_path_factory.mktemp("linear_last")
    return Refs(path, build_qwen3_next("linear_last", path))


#: (culprit, its scheduled step the fault starts at, after the model wrote?): C's 2nd step is its
#: prefill chunk [16, 32), which caches the checkpoint after 32 tokens (block 16: a state page
#: raised the requested 4); a decode step of D; A in prefill, written; then random ones
STATE_CASES = slow_except([("C", 2, False), ("C", 3, True), ("D", 4, False), ("A", 1, True)], 0, multi=True)
STATE_CASES += [pytest.param(*c, marks=pytest.mark.slow) for c in
                [(random.Random(s).choice(sorted(PROMPTS)), random.Random(s).randint(1, NEW - 1), s % 2 == 1)
                 for s in range(6)]]


@pytest.mark.parametrize("culprit,from_step,after", STATE_CASES)
def test_a_state_model_recomputes_from_checkpoints_the_failed_step_never_wrote(culprit, from_step, after, state_refs):
    """Every checkpoint kept (retention None): a failed step's checkpoints must not be hit."""
    path, want = state_refs.path, state_refs.want
    engine = _engine(path, tight=False, prefix_cache_retention_interval=None)
    assert engine.block_size == 16
    faults = Faults(engine, culprit, from_step=from_step, after=after)
    outputs = _drive(engine, {0: ["A", "C"], 2: ["B", "D"]})
    assert faults.raised >= 1 and outputs[culprit].finish_reason == "error"
    for name, out in outputs.items():
        if name != culprit:
            assert list(out.output_token_ids) == want[name], f"{name}: tokens differ from HF"
    _check_whole(engine)
    faults.on = False
    state_refs.check_again(engine)


@pytest.mark.parametrize("arch", slow_except(ARCHS, 0))
def test_a_transient_step_fault_ends_nobody(arch, refs):
    path, want = refs(arch).path, refs(arch).want
    engine = _engine(path, tight=False)
    faults = Faults(engine, None, from_step=0, after=True, transient=3)
    outputs = _drive(engine, {0: ["A", "B", "C"], 2: ["D"]})
    assert faults.raised == 1 and engine.scheduler.num_rolled_back_steps == 1
    for name, out in outputs.items():
        assert out.finish_reason == "length" and list(out.output_token_ids) == want[name], name
    _check_whole(engine)


def test_nan_logits_end_their_request_alone_without_a_rollback(refs):
    ref = refs("gemma3")
    path, want = ref.path, ref.want
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
    ref.check_again(engine)
