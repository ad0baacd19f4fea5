"""A deterministic, torch-free model runner for scheduler tests and the simulator.

The token sampled for a request depends only on the request id and how many
tokens it has produced, never on batching, prefix hits or preemption, so a
recomputed request produces exactly what it would have produced undisturbed.
"""

from __future__ import annotations

import zlib

from hybridkv.scheduler.interface import SchedulerOutput

__all__ = ["FakeRunner", "fake_token"]


def fake_token(request_id: str, num_output_tokens: int, vocab_size: int = 32000) -> int:
    """The fake model's next token: (crc32(id) + 7919 * index) mod vocab."""
    return (zlib.crc32(request_id.encode()) + 7919 * num_output_tokens) % vocab_size


class FakeRunner:
    """Returns :func:`fake_token` for each request that must sample; records what it saw."""

    def __init__(self, vocab_size: int = 32000, record: bool = False):
        self.vocab_size = vocab_size
        self.record = record
        self.steps: list[SchedulerOutput] = []
        self.num_tokens_computed = 0

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        if self.record:
            self.steps.append(output)
        out = {}
        for sr in output.scheduled:
            self.num_tokens_computed += len(sr.token_ids)
            if sr.sample:
                out[sr.request_id] = fake_token(sr.request_id, sr.num_output_tokens, self.vocab_size)
        return out
