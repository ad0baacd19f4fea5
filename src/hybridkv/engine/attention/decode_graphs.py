"""Decode steps over static, padded buffers, replayed as CUDA graphs.

A step whose sequences all decode one token (and sample it) is padded to the next
*capture size* (1, 2, 4, then multiples of 8 up to ``max_num_seqs``, as vLLM does) and
run over persistent input buffers: token ids, positions, sequence lengths, each group's
slot mapping and block table. On CUDA each size's forward pass (model and logits) is
captured once as a graph and replayed; elsewhere the same padded path runs eagerly, so
CI tests everything but the capture itself (triton's interpreter on a CPU).

Per step the host writes the metadata into one pinned buffer and sends it to the device
in one copy (the block tables, ``[G, B, W]`` of which only the step's widest table is
sent, in a second, then placed by one device copy); a padded row has sequence length 0 and slot -1, so the kernels
neither read nor write for it. Nothing in the step waits for the device except reading
the sampled token ids afterwards.

Worked example (``max_num_seqs`` 20, 3 sequences decoding at positions 9, 40, 7):
sizes [1, 2, 4, 8, 16, 24] -> the step runs the size-4 graph; rows 0-2 hold the three
tokens with sequence lengths 10, 41, 8, row 3 length 0 and slot -1.

A model whose forward cannot be captured (a mixture of experts that picks its experts
on the host) fails its first capture: the runner then runs every decode eagerly.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from hybridkv.engine.attention.metadata import AttentionMetadata, padded_tables
from hybridkv.engine.host_tensors import long_tensor
from hybridkv.engine.kv_storage import PagedKVStorage

__all__ = ["capture_sizes", "DecodeGraphs"]

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to the first one >= ``max_num_seqs``.

    >>> capture_sizes(20)
    [1, 2, 4, 8, 16, 24]
    """
    sizes = [1, 2, 4] + list(range(8, max_num_seqs + 8, 8))
    return [s for s in sizes if s < max_num_seqs] + [next(s for s in sizes if s >= max_num_seqs)]


class DecodeGraphs:
    """Static buffers and (on CUDA) one captured graph per capture size.

    ``run(tokens, computed, tables)`` -> logits ``[S, vocab]`` for ``S`` decoding
    sequences: ``tokens[s]`` at position ``computed[s]``, ``tables[s][g]`` its group-``g``
    block table.
    """

    def __init__(self, model, storage: PagedKVStorage, max_num_seqs: int, max_model_len: int,
                 capture: bool | None = None) -> None:
        self.model = model
        self.storage = storage
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = b = self.sizes[-1]
        self.width = w = -(-max_model_len // storage.block_size)
        self.num_groups = g = storage.num_groups
        self.device = device = storage.device
        self.capture = device.type == "cuda" if capture is None else capture

        pin = device.type == "cuda"
        # [ids B | positions B | seq_lens B | slots G*B], int64, one copy per step
        self._host = torch.empty((3 + g) * b, dtype=torch.long, pin_memory=pin)
        self._dev = torch.zeros((3 + g) * b, dtype=torch.long, device=device)
        # a step's tables [n, G, widest] go contiguous through a pinned and a device staging buffer
        # (grown on demand); the tables the graphs read are int32, as vLLM's: [B, G, W]
        self._pin = pin
        self._host_tables = torch.zeros(0, dtype=torch.int32, pin_memory=pin)
        self._staged_tables = torch.zeros(0, dtype=torch.int32, device=device)
        self.tables = torch.zeros(b, g, w, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.seq_lens = self._dev[:b], self._dev[b : 2 * b], self._dev[2 * b : 3 * b]
        self.slots = self._dev[3 * b :].view(g, b)  # [G, B]
        self.max_model_len = max_model_len
        self._meta = {size: self._metadata(size) for size in self.sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.graphs_failed: str | None = None  # why capture was given up (the runs go on eagerly)

    def fits(self, num_seqs: int, widest: int) -> bool:
        """Whether a decode batch of ``num_seqs`` with tables up to ``widest`` blocks runs here."""
        return num_seqs <= self.max_batch and widest <= self.width

    def _metadata(self, size: int) -> AttentionMetadata:
        """Attention metadata over the first ``size`` rows of the static buffers."""
        return AttentionMetadata(
            storage=self.storage, positions=self.positions[:size], start=self.positions[:size],
            q_len=torch.ones(size, dtype=torch.long, device=self.device), seq_len=self.seq_lens[:size],
            starts=[0] * size, query_lens=[1] * size,
            block_tables=[self.tables[:size, g] for g in range(self.num_groups)],
            slot_mappings=[self.slots[g, :size] for g in range(self.num_groups)],
            output_seqs=None, backend="triton", decode_key_bound=self.max_model_len,
        )

    def _load(self, tokens: Sequence[int], computed: Sequence[int], tables: Sequence[Sequence[Sequence[int]]],
              size: int) -> None:
        """Write the step into the host buffers, padded to ``size`` rows, and send them."""
        n, b, bs = len(tokens), self.max_batch, self.storage.block_size
        pad = size - n
        host = self._host
        host[:n] = long_tensor(tokens)
        host[n:size] = 0
        host[b : b + n] = long_tensor(computed)
        host[b + n : b + size] = 0
        host[2 * b : 2 * b + n] = host[b : b + n] + 1
        host[2 * b + n : 2 * b + size] = 0
        flat, widest = padded_tables(tables)  # [n, G, widest]
        slots: list[int] = []  # [G, size]: the new token's slot in each group's table
        for g in range(self.num_groups):
            slots.extend(per_seq[g][p // bs] * bs + p % bs for per_seq, p in zip(tables, computed))
            slots.extend([-1] * pad)
        host[3 * b :].view(self.num_groups, b)[:, :size] = long_tensor(slots).view(self.num_groups, size)
        count = len(flat)
        if count > self._host_tables.numel():  # the last step's copies are done (its ids were read)
            size_up = max(count, 2 * self._host_tables.numel())
            self._host_tables = torch.zeros(size_up, dtype=torch.int32, pin_memory=self._pin)
            self._staged_tables = torch.zeros(size_up, dtype=torch.int32, device=self.device)
        self._host_tables[:count] = long_tensor(flat)
        nb = self.device.type == "cuda"
        self._dev.copy_(host, non_blocking=nb)
        staged = self._staged_tables[:count]
        staged.copy_(self._host_tables[:count], non_blocking=nb)
        self.tables[:n, :, :widest] = staged.view(n, self.num_groups, widest)

    def _forward(self, size: int) -> torch.Tensor:
        meta = self._meta[size]
        meta.renew_state()  # the backend's per-step values are made anew, inside a capture too
        hidden = self.model(self.input_ids[:size], self.positions[:size], meta)  # [size, hidden]
        return self.model.compute_logits(hidden)  # [size, vocab]

    def run(self, tokens: Sequence[int], computed: Sequence[int],
            tables: Sequence[Sequence[Sequence[int]]]) -> torch.Tensor:
        """Logits [S, vocab] of ``S`` sequences decoding ``tokens`` at positions ``computed``."""
        size = next(s for s in self.sizes if s >= len(tokens))
        self._load(tokens, computed, tables, size)
        if not self.capture or self.graphs_failed is not None:
            return self._forward(size)[: len(tokens)]
        graph = self._graphs.get(size)
        if graph is None:
            graph = self._capture(size)
            if graph is None:
                return self._forward(size)[: len(tokens)]
        graph[0].replay()
        return graph[1][: len(tokens)].clone()  # the graph's output is overwritten by the next replay

    def _capture(self, size: int):
        """Capture ``size``'s forward (the buffers hold a real step: its writes repeat the same values)."""
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the kernels and settle the allocator outside the capture
                    self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(size)
        except Exception as exc:  # a model with host-side control flow: run eagerly from now on
            self.graphs_failed = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, decode runs eagerly: %s", self.graphs_failed)
            torch.cuda.synchronize(self.device)
            return None
        self._graphs[size] = (graph, out)
        return self._graphs[size]

