"""The engine: a model, its paged KV, the hybrid KV cache manager and the scheduler.

    engine = LLMEngine("path/to/model_dir", EngineConfig(block_size=8, num_blocks=512))
    outputs = engine.generate([[1, 2, 3], [1, 2, 4]], SamplingParams(max_tokens=16))

Built from the pieces in layer order: the model says each layer's attention type →
core specs → the planner groups the layers (equal group sizes, tensors shared by
position) → ``KVCacheManager`` over the groups → ``Scheduler`` → ``PagedModelRunner``
over a ``PagedKVStorage`` laid out like the groups. Prefix caching is on by default.
A request stops at the model's EOS ids (``config.json`` and ``generation_config.json``
``eos_token_id``) and at its ``stop_token_ids``; ``SamplingParams(ignore_eos=True)``
keeps only the latter.

Bad input is refused before any state changes: token ids outside the vocabulary,
empty prompts and prompts longer than ``max_model_len`` raise typed errors from
``add_request``; a pool too small for a request raises ``PoolTooSmallError`` there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from hybridkv.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, CacheManagerConfig, KVCacheConfig, KVCacheGroup
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.engine.kv_storage import PagedKVStorage, check_allocation
from hybridkv.engine.model_runner import PagedModelRunner
from hybridkv.engine.models import load_model
from hybridkv.engine.models.base import CausalLM
from hybridkv.errors import InvalidArgumentError, InvalidConfigError
from hybridkv.planner.grouping import Grouping, group_layers
from hybridkv.planner.sizes import parse_bytes
from hybridkv.scheduler.config import SchedulerConfig
from hybridkv.scheduler.interface import SamplingParams
from hybridkv.scheduler.scheduler import Scheduler
from hybridkv.scheduler.sequence import FinishReason

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to build the engine. Give the pool as ``num_blocks`` or ``kv_cache_memory``."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = 64
    admission: str = "full_prompt"  # SchedulerConfig.admission (vLLM's default; or "first_chunk")
    enable_prefix_caching: bool = True
    group_size: int | None = None  # default: the planner's choice
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    debug_checks: bool = False  # check every KV write for null-block slots

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise InvalidConfigError("give num_blocks or kv_cache_memory, not both")


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str
    num_cached_tokens: int
    num_preemptions: int


class LLMEngine:
    """Continuous batching over a hybrid paged KV cache, on a model loaded from disk."""

    def __init__(self, model: str | Path | CausalLM, config: EngineConfig = EngineConfig()):
        self.config = config
        self.model = model if isinstance(model, CausalLM) else load_model(model, dtype=config.dtype, device=config.device)
        m = self.model
        if config.max_model_len is not None and config.max_model_len > m.max_position_embeddings:
            # as vLLM: positions past the model's own limit are not what it was made for
            raise InvalidConfigError(
                f"max_model_len {config.max_model_len:,} exceeds the model's max_position_embeddings "
                f"{m.max_position_embeddings:,}"
            )
        self.max_model_len = config.max_model_len or m.max_position_embeddings
        specs = m.kv_cache_specs(config.block_size, dtype=config.dtype)
        memory = self._kv_cache_memory = None if config.kv_cache_memory is None else parse_bytes(config.kv_cache_memory)
        self.grouping: Grouping = group_layers(
            specs,
            self.max_model_len,
            group_size=config.group_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            memory_bytes=memory,
        )
        num_blocks = self._num_blocks()
        # before any per-block state exists: a huge pool is refused, not built for minutes
        check_allocation(num_blocks * self.grouping.bytes_per_block, config.device, f"a KV cache of {num_blocks:,} blocks")
        self.kv_cache_config = KVCacheConfig(
            num_blocks,
            tuple(KVCacheGroup(g.spec, tuple(f"model.layers.{i}" for i in g.layers)) for g in self.grouping.groups),
        )
        self.kv = KVCacheManager(
            self.kv_cache_config,
            CacheManagerConfig(max_model_len=self.max_model_len, enable_caching=config.enable_prefix_caching),
        )
        self.scheduler = Scheduler(
            self.kv,
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                admission=config.admission,
            ),
        )
        self.storage = PagedKVStorage(
            [list(g.layers) for g in self.grouping.groups],
            config.block_size,
            num_blocks,
            m.num_kv_heads,
            m.head_dim,
            dtype=config.dtype,
            device=config.device,
            debug=config.debug_checks,
        )
        self.runner = PagedModelRunner(m, self.storage, seed=config.seed)
        #: where requests stop unless they ask ``ignore_eos`` (config.json + generation_config.json)
        self.eos_token_ids: tuple[int, ...] = m.eos_token_ids
        self._ids = itertools.count()
        self._outputs: dict[str, RequestOutput] = {}

    def _num_blocks(self) -> int:
        """The pool: as given, or what ``kv_cache_memory`` holds, or by default room for
        ``max_num_seqs`` requests of ``max_model_len`` (the specs' one per-request bound at
        this engine's ``max_num_batched_tokens``), capped at 1 GiB but never below one
        whole request and the null block."""
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_cache_memory is None:
            per_request = self.grouping.blocks_per_request(self.max_model_len)
            cap = (1 << 30) // self.grouping.bytes_per_block
            return max(per_request + 1, min(cfg.max_num_seqs * per_request + 1, cap))
        return self._kv_cache_memory // self.grouping.bytes_per_block

    # --------------------------------------------------------------- requests
    def add_request(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a prompt; returns its request id."""
        prompt = list(prompt_token_ids)
        vocab = self.model.vocab_size
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(f"token ids must be ints in [0, {vocab}); got {bad[:5]}")
        if not prompt:
            raise InvalidArgumentError("the prompt is empty")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.scheduler.add_request(rid, prompt, (sampling or SamplingParams()).with_eos(self.eos_token_ids))
        return rid

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One scheduler step through the model; the requests that finished in it."""
        _, finished = self.scheduler.step(self.runner)
        out = []
        for seq in finished:
            r = seq.request
            ro = RequestOutput(
                r.request_id,
                tuple(r.all_token_ids[: r.num_prompt_tokens]),
                tuple(r.output_token_ids),
                (seq.finish_reason or FinishReason.LENGTH).value,
                seq.num_cached_tokens,
                seq.num_preemptions,
            )
            self._outputs[r.request_id] = ro
            out.append(ro)
        return out

    def generate(
        self,
        prompts: Iterable[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        max_steps: int = 1_000_000,
    ) -> list[RequestOutput]:
        """Run prompts to completion (batched through the scheduler); outputs in prompt order."""
        prompts = [list(p) for p in prompts]
        if isinstance(sampling, SamplingParams) or sampling is None:
            params = [sampling or SamplingParams()] * len(prompts)
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise InvalidArgumentError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        steps = 0
        while self.has_unfinished_requests():
            if steps >= max_steps:
                raise InvalidArgumentError(f"not finished after {max_steps} steps")
            self.step()
            steps += 1
        return [self._outputs.pop(rid) for rid in ids]

    @property
    def last_logits(self) -> dict[str, torch.Tensor]:
        """Logits of the last step, per request that sampled (for tests)."""
        return self.runner.last_logits
