"""Trace-driven simulation: the same requests through a hybrid and an all-full KV cache.

Both runs use the same byte budget (the planner's two layouts), the same scheduler
limits and admission policy (``SchedulerConfig.admission``, vLLM's default
``"full_prompt"`` unless told otherwise; each result names it) and the fake runner,
so the only difference is how many blocks the KV cache has and which ones it can
give back. Per step the simulator records KV usage (the
fraction of the pool's bytes that requests hold) and the number of running requests.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

from hybridkv.core.config import CacheManagerConfig, KVCacheConfig
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.core.usage import usable_blocks
from hybridkv.errors import PoolTooSmallError
from hybridkv.scheduler.config import SchedulerConfig
from hybridkv.scheduler.fake_runner import FakeRunner
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.scheduler import Scheduler
from hybridkv.scheduler.workloads import TraceRequest

__all__ = ["SimulationResult", "simulate", "Progress"]


@dataclass
class SimulationResult:
    """What one layout did with one trace."""

    name: str
    num_blocks: int
    bytes_per_block: int
    admission: str = "full_prompt"  # the scheduler's admission policy (SchedulerConfig.admission)
    steps: int = 0
    finished: int = 0
    rejected: list[str] = field(default_factory=list)
    computed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    prompt_tokens_admitted: int = 0
    hit_tokens: int = 0
    usage: list[float] = field(default_factory=list, repr=False)
    running: list[int] = field(default_factory=list, repr=False)
    wall_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.computed_tokens / self.steps if self.steps else 0.0

    @property
    def peak_usage(self) -> float:
        return max(self.usage, default=0.0)

    @property
    def mean_usage(self) -> float:
        return sum(self.usage) / len(self.usage) if self.usage else 0.0

    @property
    def peak_running(self) -> int:
        return max(self.running, default=0)

    @property
    def mean_running(self) -> float:
        return sum(self.running) / len(self.running) if self.running else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens_admitted if self.prompt_tokens_admitted else 0.0

    def summary(self) -> dict:
        return {
            "layout": self.name,
            "admission": self.admission,
            "num_blocks": self.num_blocks,
            "steps": self.steps,
            "finished": self.finished,
            "rejected": len(self.rejected),
            "tokens_per_step": round(self.tokens_per_step, 2),
            "generated_tokens": self.generated_tokens,
            "peak_kv_usage": round(self.peak_usage, 4),
            "mean_kv_usage": round(self.mean_usage, 4),
            "peak_running": self.peak_running,
            "mean_running": round(self.mean_running, 2),
            "preemptions": self.preemptions,
            "prefix_hit_rate": round(self.hit_rate, 4),
            "wall_seconds": round(self.wall_seconds, 3),
        }


class Progress:
    """A one-line progress bar on stderr (no dependency); silent when disabled."""

    def __init__(self, total: int, label: str, enabled: bool | None = None, stream=None):
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._last = -1.0

    def update(self, done: int, extra: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < self.total:
            return
        self._last = now
        width = 30
        filled = int(width * done / self.total)
        self.stream.write(f"\r{self.label:>7} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {extra}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def simulate(
    name: str,
    kv_cache_config: KVCacheConfig,
    trace: Sequence[TraceRequest],
    scheduler_config: SchedulerConfig,
    *,
    bytes_per_block: int = 1,
    enable_caching: bool = True,
    max_steps: int = 1_000_000,
    progress: bool | None = False,
    check_invariants_every: int = 0,
) -> SimulationResult:
    """Run ``trace`` to completion on one layout; requests that can never fit are rejected."""
    started = time.perf_counter()
    kv = KVCacheManager(
        kv_cache_config, CacheManagerConfig(max_model_len=scheduler_config.max_model_len, enable_caching=enable_caching)
    )
    sched = Scheduler(kv, scheduler_config)
    runner = FakeRunner()
    result = SimulationResult(name, kv_cache_config.num_blocks, bytes_per_block, scheduler_config.admission)
    pending = sorted(trace, key=lambda r: r.arrival_step)
    usable = usable_blocks(kv_cache_config.num_blocks)
    bar = Progress(len(pending), name, progress)
    next_arrival = 0
    done = 0
    while next_arrival < len(pending) or sched.has_unfinished_requests():
        step = sched.step_count
        if step >= max_steps:
            raise PoolTooSmallError(f"{name}: trace not finished after {max_steps} steps")
        while next_arrival < len(pending) and pending[next_arrival].arrival_step <= step:
            tr = pending[next_arrival]
            next_arrival += 1
            try:
                sched.add_request(tr.request_id, tr.prompt_token_ids, SamplingParams(max_tokens=tr.output_len))
            except PoolTooSmallError:
                result.rejected.append(tr.request_id)
                done += 1
        if not sched.has_unfinished_requests():
            sched.step_count += 1  # idle until the next arrival
            result.usage.append(0.0)
            result.running.append(0)
            continue
        waiting_before = {s.request_id for s in sched.waiting}
        output, finished = sched.step(runner)
        for sr in output.scheduled:
            result.computed_tokens += len(sr.token_ids)
            if sr.request_id in waiting_before:  # admitted this step (first time or after preemption)
                seq = sched.sequences.get(sr.request_id) or next(f for f in finished if f.request_id == sr.request_id)
                result.prompt_tokens_admitted += seq.request.num_tokens
                result.hit_tokens += sr.num_computed_tokens
        result.generated_tokens += sum(1 for sr in output.scheduled if sr.sample)
        result.finished += len(finished)
        done += len(finished)
        result.usage.append((usable - kv.num_free_blocks) / usable)
        result.running.append(sched.num_running + len(finished))
        if check_invariants_every and output.step % check_invariants_every == 0:
            sched.check_invariants()
        bar.update(done, f"step {output.step}")
    bar.close()
    result.steps = sched.step_count
    result.preemptions = sched.num_preemptions
    result.wall_seconds = time.perf_counter() - started
    return result
