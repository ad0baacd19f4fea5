"""A test-only scheduler loop: drives PagedModelRunner with SchedulerOutputs.

FCFS, chunked prefill (``prefill_chunk`` tokens per request per step), all running
requests batched in one step, optional prefix sharing, and recompute preemption
(newest running request first) when the pool runs short. Returns every request's
output tokens and the logits that produced each of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tests.support.naive_blocks import NaiveBlocks

from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.engine.model_runner import PagedModelRunner
from hybridkv.scheduler.interface import SamplingParams, ScheduledRequest, SchedulerOutput


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_new: int
    arrival: int = 0
    sampling: SamplingParams | None = None
    output: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    computed: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class RunResult:
    outputs: dict[str, list[int]]
    logits: dict[str, torch.Tensor]  # [max_new, vocab]
    steps: int
    preemptions: int
    blocks: NaiveBlocks


def layout_groups(types: list, group_size: int | None = None) -> list[list[int]]:
    """Layers grouped by attention type, each type split into groups of ``group_size`` layers."""
    by_type: dict = {}
    for i, t in enumerate(types):
        by_type.setdefault(t, []).append(i)
    size = group_size or min(len(v) for v in by_type.values())
    groups = []
    for layers in by_type.values():
        groups += [layers[i : i + size] for i in range(0, len(layers), size)]
    return groups


def run_engine(
    model,
    requests: list[Req],
    block_size: int,
    num_blocks: int,
    prefill_chunk: int = 7,
    prefix_sharing: bool = False,
    group_size: int | None = None,
    max_steps: int = 2000,
) -> RunResult:
    types = [model.attention_type(i) for i in range(model.num_layers)]
    groups = layout_groups(types, group_size)
    storage = PagedKVStorage(groups, block_size, num_blocks, model.num_kv_heads, model.head_dim)
    runner = PagedModelRunner(model, storage)
    blocks = NaiveBlocks([types[g[0]] for g in groups], block_size, num_blocks, storage)

    waiting = sorted(requests, key=lambda r: r.arrival)
    running: list[Req] = []
    done: list[Req] = []
    preemptions = 0
    step = 0
    while waiting or running:
        assert step < max_steps, "engine made no progress"
        while waiting and waiting[0].arrival <= step:
            r = waiting.pop(0)
            blocks.add(r.rid)
            if prefix_sharing:
                donors = {o.rid: (o.tokens, o.computed) for o in running}
                r.computed = blocks.share_prefix(r.rid, r.tokens, donors)
            running.append(r)
        scheduled: list[tuple[Req, int]] = []
        for r in list(running):
            if r not in running:  # preempted by an earlier request this step
                continue
            num_new = min(prefill_chunk, len(r.tokens) - r.computed)
            while not blocks.allocate(r.rid, r.computed, num_new):
                victim = running[-1]
                running.remove(victim)
                blocks.release_all(victim.rid)
                victim.computed = 0
                waiting.insert(0, victim)
                preemptions += 1
                scheduled = [(s, n) for s, n in scheduled if s is not victim]
                if victim is r:
                    break
            else:
                scheduled.append((r, num_new))
        if not scheduled:
            step += 1
            continue
        out = SchedulerOutput(
            step=step,
            scheduled=tuple(
                ScheduledRequest(
                    request_id=r.rid,
                    token_ids=r.tokens[r.computed : r.computed + n],
                    num_computed_tokens=r.computed,
                    block_ids=blocks.block_ids(r.rid),
                    sample=r.computed + n == len(r.tokens),
                    sampling=r.sampling or SamplingParams(max_tokens=r.max_new),
                    num_output_tokens=len(r.output),
                )
                for r, n in scheduled
            ),
        )
        sampled = runner.execute(out)
        for r, n in scheduled:
            r.computed += n
            if r.rid in sampled:
                r.logits[len(r.output)] = runner.last_logits[r.rid].clone()
                r.output.append(sampled[r.rid])
                if len(r.output) == r.max_new:
                    running.remove(r)
                    blocks.release_all(r.rid)
                    done.append(r)
        step += 1
    return RunResult(
        outputs={r.rid: r.output for r in done},
        logits={r.rid: torch.stack([r.logits[i] for i in range(r.max_new)]) for r in done},
        steps=step,
        preemptions=preemptions,
        blocks=blocks,
    )
