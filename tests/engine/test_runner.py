"""PagedModelRunner: SchedulerOutput in, sampled tokens out; sampling; input checks."""

from __future__ import annotations

import pytest
import torch
from tests.support.engine_driver import Req, run_engine
from tests.support.hf_tiny import hf_generate

from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.engine.model_runner import PagedModelRunner
from hybridkv.engine.models import load_model
from hybridkv.engine.sampling import Sampler
from hybridkv.errors import InvalidArgumentError, InvalidConfigError
from hybridkv.scheduler.interface import SamplingParams, ScheduledRequest, SchedulerOutput


@pytest.fixture(scope="module")
def llama4(tiny_models):
    path, hf = tiny_models("llama4_moe")
    return load_model(path), hf


def _prompt(n, seed):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(model, block_size=8, num_blocks=64):
    groups = [[i] for i in range(model.num_layers)]
    return PagedModelRunner(model, PagedKVStorage(groups, block_size, num_blocks, model.num_kv_heads, model.head_dim))


def test_one_prefill_step_then_decode_by_hand(llama4):
    model, hf = llama4
    prompt = _prompt(19, 0)
    want, want_logits = hf_generate(hf, prompt, 2)
    runner = _runner(model)
    # one layer per group, all in tensor 0: each group needs its own blocks
    tables = tuple([3 * g + 1, 3 * g + 2, 3 * g + 3] for g in range(model.num_layers))
    step0 = ScheduledRequest("a", prompt[:10], 0, tables, sample=False)
    assert runner.execute(SchedulerOutput(0, (step0,))) == {}
    assert runner.last_logits == {}
    step1 = ScheduledRequest("a", prompt[10:], 10, tables, sample=True)
    out = runner.execute(SchedulerOutput(1, (step1,)))
    assert out == {"a": want[0]}
    torch.testing.assert_close(runner.last_logits["a"], want_logits[0], atol=1e-4, rtol=0)
    step2 = ScheduledRequest("a", [want[0]], 19, tables, sample=True, num_output_tokens=1)
    assert runner.execute(SchedulerOutput(2, (step2,))) == {"a": want[1]}


def test_seeded_sampling_is_independent_of_batching_and_chunking(llama4):
    model, _ = llama4
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, seed=7)
    prompt = _prompt(30, 1)
    alone = run_engine(model, [Req("x", prompt, 12, sampling=params)], block_size=8, num_blocks=128, prefill_chunk=30)
    others = [Req(f"o{i}", _prompt(20 + i, 10 + i), 12) for i in range(3)]
    batched = run_engine(
        model, [Req("x", prompt, 12, sampling=params), *others], block_size=4, num_blocks=256, prefill_chunk=5
    )
    assert alone.outputs["x"] == batched.outputs["x"]
    greedy = run_engine(model, [Req("x", prompt, 12)], block_size=8, num_blocks=128)
    assert alone.outputs["x"] != greedy.outputs["x"]  # it really sampled
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, seed=8)
    reseeded = run_engine(model, [Req("x", prompt, 12, sampling=other_seed)], block_size=8, num_blocks=128)
    assert reseeded.outputs["x"] != alone.outputs["x"]


def test_sampler_filters():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0])
    s = Sampler(0)
    assert s.sample(logits, SamplingParams(), 0) == 1
    for seed in range(20):
        assert s.sample(logits, SamplingParams(temperature=5.0, top_k=1, seed=seed), 0) == 1
        assert s.sample(logits, SamplingParams(temperature=5.0, top_k=2, seed=seed), 0) in (1, 3)
        assert s.sample(logits, SamplingParams(temperature=5.0, top_p=0.01, seed=seed), 0) == 1
    unseeded = {s.sample(logits, SamplingParams(temperature=50.0), i) for i in range(60)}
    assert len(unseeded) > 2


def test_sample_rows_equals_row_by_row_sampling():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=5, seed=11),
        SamplingParams(),
        SamplingParams(temperature=1.3),  # unseeded: draws from the sampler's own generator, in row order
        SamplingParams(temperature=0.9, top_p=0.8, seed=2),
    ]
    counts = [0, 3, 1, 4, 9]
    one_by_one = Sampler(5)
    want = [one_by_one.sample(logits[i], p, n) for i, (p, n) in enumerate(zip(params, counts))]
    assert Sampler(5).sample_rows(logits, params, counts) == want
    assert want[0] == int(logits[0].argmax()) and want[2] == int(logits[2].argmax())


def test_execute_rejects_bad_steps(llama4):
    model, _ = llama4
    runner = _runner(model)
    tables = tuple([1, 2] for _ in range(model.num_layers))
    ok = ScheduledRequest("a", [1, 2], 0, tables, sample=True)
    with pytest.raises(InvalidArgumentError, match="twice"):
        runner.execute(SchedulerOutput(0, (ok, ok)))
    with pytest.raises(InvalidArgumentError, match="no tokens"):
        runner.execute(SchedulerOutput(0, (ScheduledRequest("b", [], 0, tables, sample=True),)))
    with pytest.raises(InvalidArgumentError, match="block tables"):
        runner.execute(SchedulerOutput(0, (ScheduledRequest("d", [1], 0, ([1],), sample=True),)))
    assert runner.execute(SchedulerOutput(0, ())) == {}


def test_runner_checks_storage_layout(llama4):
    model, _ = llama4
    n = model.num_layers
    with pytest.raises(InvalidConfigError, match="covers layers"):
        PagedModelRunner(model, PagedKVStorage([[0]], 4, 8, model.num_kv_heads, model.head_dim))
    with pytest.raises(InvalidConfigError, match="heads"):
        PagedModelRunner(model, PagedKVStorage([list(range(n))], 4, 8, 1, model.head_dim))
    # layer 3 is NoPE full attention, layers 0-2 chunked: one group cannot hold both
    with pytest.raises(InvalidConfigError, match="mixes attention types"):
        PagedModelRunner(model, PagedKVStorage([list(range(n))], 4, 8, model.num_kv_heads, model.head_dim))


def test_pinned_stager_regions_never_alias_within_a_step():
    """Uploads of one step keep their values while later ones fill (and outgrow) the buffer."""
    from hybridkv.engine.host_tensors import PinnedStager

    stager = PinnedStager("cpu", capacity=8)
    rng = torch.Generator().manual_seed(0)
    for _ in range(3):  # steps
        stager.reset()
        sent = []
        for n in torch.randint(0, 7, (12,), generator=rng).tolist():
            values = torch.randint(-(2**40), 2**40, (n,), generator=rng).tolist()
            sent.append((values, stager.long_tensor(values)))
        for values, tensor in sent:
            assert tensor.tolist() == values and tensor.dtype == torch.long


def test_threads_fit_the_cores_the_process_may_use():
    import os

    from hybridkv.engine.cpu_process import fit_threads_to_affinity

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(64)
        allowed = len(os.sched_getaffinity(0))
        assert fit_threads_to_affinity() == min(64, allowed)
        torch.set_num_threads(1)
        assert fit_threads_to_affinity() == 1  # never raised
    finally:
        torch.set_num_threads(before)
