"""The engine: a model, its paged KV, the hybrid KV cache manager and the scheduler.

    engine = LLMEngine("path/to/model_dir", EngineConfig(block_size=8, num_blocks=512))
    outputs = engine.generate([[1, 2, 3], [1, 2, 4]], SamplingParams(max_tokens=16))

Built from the pieces in layer order: the model's config → the planner's caches and
groups (:class:`~hybridkv.engine.kv_layout.KVLayout`: equal group sizes, tensors shared
by position) → ``KVCacheManager`` over the groups → ``Scheduler`` → ``PagedModelRunner``
over a ``PagedKVStorage`` laid out like the attention groups. Prefix caching is on by default.

Models with linear-attention layers (Qwen3-Next, Qwen3.5) have state groups too: the
manager keeps their tables (a state checkpoint per block position), the runner's
:class:`~hybridkv.engine.state_runner.StateRunner` keeps the states, one slot per block
id, and the block size is the planner's (a state page may raise ``block_size``, the
requested one: :attr:`LLMEngine.block_size` is the one in use). Which checkpoints stay
cached: ``prefix_cache_retention_interval`` (vLLM's; 0, the default, keeps the prompt's last).
A request stops at the model's EOS ids (``config.json`` and ``generation_config.json``
``eos_token_id``) and at its ``stop_token_ids``; ``SamplingParams(ignore_eos=True)``
keeps only the latter.

``EngineConfig(hybrid=False)`` keeps every layer's KV as full attention (the planner's
all-full layout, ``--no-hybrid``): only the cache layout changes, each layer still
attends within its own window / chunk, so the outputs are the same.

Streaming: :meth:`LLMEngine.step_deltas` returns, per request that advanced in the
step, its new token ids and (when it finished) its :class:`RequestOutput`;
:meth:`LLMEngine.step` returns only the finished ones. :meth:`LLMEngine.abort_request`
ends a request at once, freeing its blocks. :meth:`LLMEngine.kv_summary` reports
blocks in use per group, prefix hits, preemptions and KV bytes per request against
the all-full layout (:mod:`hybridkv.engine.kv_summary`).

One request's failure stays its own: a request whose logits are a model fault ends
with finish reason ``"error"`` and the others sample as usual; a step whose model run
raises is rolled back (:meth:`~hybridkv.scheduler.scheduler.Scheduler.roll_back`: its
unwritten blocks uncached, its requests recomputed, each alone until the one that fails
again is found and ends with ``"error"``; :attr:`RequestOutput.error` says why).

``SamplingParams(prompt_logprobs=k)`` scores the prompt (:mod:`hybridkv.engine.prompt_logprobs`):
such a request takes no prefix hit, its chunks' rows go through the output projection in
slices, and its values come once, complete, in the step of its first token
(:attr:`RequestDelta.prompt_logprobs`, :attr:`RequestOutput.prompt_logprobs`), however often
it was preempted and recomputed.

``SamplingParams(structured_outputs=...)`` keeps a request's tokens inside a grammar (a JSON
schema, a regex, a choice, a Lark grammar: :mod:`hybridkv.engine.structured`); one that does
not compile is refused by ``add_request``.

Bad input is refused before any state changes: token ids outside the vocabulary,
empty prompts and prompts longer than ``max_model_len`` raise typed errors from
``add_request``; a pool too small for a request raises ``PoolTooSmallError`` there.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from hybridkv.checkpoint import ModelSource
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.engine import cpu_ops
from hybridkv.engine.attention.decode_graphs import DecodeGraphs
from hybridkv.engine_config import EngineConfig
from hybridkv.engine.cpu_process import fit_threads_to_affinity, keep_freed_memory
from hybridkv.engine.attention.registry import get_backend, resolve_backend
from hybridkv.engine.kv_storage import PagedKVStorage, check_allocation, torch_dtype
from hybridkv.engine.kv_layout import KVLayout
from hybridkv.engine.kv_summary import KVSummary, UsageTracker, kv_bytes_per_request, state_bytes_per_request
from hybridkv.engine.model_runner import PagedModelRunner
from hybridkv.engine.models import load_model, resolve_quantization
from hybridkv.engine.layers.quantized_linear import check_quantization
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.outputs import Progress, RequestDelta, RequestOutput, prompt_scores
from hybridkv.engine.state_runner import StateRunner
from hybridkv.engine.structured import StructuredOutputs
from hybridkv.errors import InvalidArgumentError, InvalidConfigError, UnknownRequestError
from hybridkv.tokenizer.prompts import check_token_ids, checkpoint_tokenizer
from hybridkv.planner.grouping import Grouping
from hybridkv.planner.sizes import parse_bytes
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.scheduler import Scheduler
from hybridkv.scheduler.sequence import FinishReason, Sequence as Seq

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "RequestDelta"]

log = logging.getLogger("hybridkv.engine")

#: :attr:`RequestOutput.error` of a request whose logits were not numbers
NOT_NUMBERS = "the model's logits for this request were not numbers (nan or inf)"


class LLMEngine:
    """Continuous batching over a hybrid paged KV cache, on a loaded model or one to load (a model
    directory, a ``.gguf`` file, an installed model's name: :func:`~hybridkv.engine.models.load_model`)."""

    def __init__(self, model: str | Path | ModelSource | CausalLM, config: EngineConfig = EngineConfig()):
        self.config = config
        #: the weights' form in force: config.quantization resolved for this model (None: exact)
        q = config.quantization
        if isinstance(model, CausalLM):  # a loaded model: "auto" takes its form
            self.quantization = model.quantization if q == "auto" else None if q == "none" else q
        else:
            self.quantization = resolve_quantization(q, model, config.dtype, config.device)
        #: the attention backend in use (a registered name), resolved from config.attention_backend
        self.attention_backend = resolve_backend(config.attention_backend, torch.device(config.device).type,
                                                 quantized=self.quantization is not None)
        check_quantization(self.quantization, config.device)  # before the model loads
        if torch.device(config.device).type == "cpu":
            fit_threads_to_affinity()
            keep_freed_memory()
        if isinstance(model, CausalLM):
            if model.quantization != self.quantization:
                raise InvalidConfigError(
                    f"the model's weights are {model.quantization or 'not quantized'}; the config asks "
                    f"{self.quantization or 'none'} (load it with load_model(..., quantization=...))"
                )
            if model.weight_dtype != torch_dtype(config.dtype):
                raise InvalidConfigError(
                    f"the model is in {model.weight_dtype}, the config's dtype is {config.dtype} "
                    "(the KV cache and its sizes follow the config: load the model in that dtype)"
                )
            self.model = model
        else:
            self.model = load_model(model, dtype=config.dtype, device=config.device, quantization=self.quantization)
        m = self.model
        if config.max_model_len is not None and config.max_model_len > m.max_position_embeddings:
            # as vLLM: positions past the model's own limit are not what it was made for
            raise InvalidConfigError(
                f"max_model_len {config.max_model_len:,} exceeds the model's max_position_embeddings "
                f"{m.max_position_embeddings:,}"
            )
        self.max_model_len = config.max_model_len or m.max_position_embeddings
        memory = None if config.kv_cache_memory is None else parse_bytes(config.kv_cache_memory)
        #: the caches, groups and pool arithmetic (the planner's, at this engine's dtypes: KV at config.kv_dtype)
        self.layout = layout = KVLayout.plan(
            m.config, family=m.family, block_size=config.block_size, dtype=config.dtype, kv_dtype=config.kv_dtype,
            max_model_len=self.max_model_len, max_num_batched_tokens=config.max_num_batched_tokens,
            hybrid=config.hybrid, group_size=config.group_size, memory_bytes=memory, tail_only=config.tail_only,
        )
        #: the layers as the planner reads them (the specs of the hybrid layout)
        self.layers = layout.layers
        #: every layer as full attention: the ``hybrid=False`` layout and the figure it is compared with
        self.full_grouping: Grouping = layout.full_grouping
        self.grouping: Grouping = layout.grouping
        #: tokens per block: the requested ``block_size``, or more when a state page raised it
        self.block_size = layout.block_size
        num_blocks = layout.num_blocks(config.num_blocks, memory, config.max_num_seqs)
        # before any per-block state exists: a huge pool is refused, not built for minutes
        check_allocation(layout.allocation_bytes(num_blocks), config.device, f"a KV cache of {num_blocks:,} blocks")
        self.kv_cache_config = layout.kv_cache_config(num_blocks)
        self.kv = KVCacheManager(self.kv_cache_config, config.cache_manager_config(self.max_model_len))
        self.scheduler = Scheduler(self.kv, config.scheduler_config(self.max_model_len))
        attention = layout.attention_groups
        self.storage = PagedKVStorage(
            [list(g.layers) for g in attention.values()],
            self.block_size,
            num_blocks,
            m.num_kv_heads,
            m.head_dim,
            dtype=config.kv_dtype,
            device=config.device,
            debug=config.debug_checks,
        )
        #: the linear-attention layers' states (None for attention-only models)
        self.states: StateRunner | None = None
        if layout.state_groups:
            self.states = StateRunner(
                {g: group.layers for g, group in layout.state_groups.items()}, self.grouping.num_groups,
                self.block_size, num_blocks, m.state_shape(), dtype=torch_dtype(config.dtype), device=config.device,
            )
        #: pure-decode steps over static padded buffers, replayed as CUDA graphs on CUDA (None: all eager)
        self.decode_graphs: DecodeGraphs | None = None
        if (get_backend(self.attention_backend).decode_graphs and not config.enforce_eager and self.states is None
                and m.supports_cuda_graphs):
            self.decode_graphs = DecodeGraphs(m, self.storage, config.max_num_seqs, self.max_model_len)
        self.runner = PagedModelRunner(m, self.storage, seed=config.seed,
                                       group_specs=[g.spec for g in attention.values()], states=self.states,
                                       attention_backend=self.attention_backend, decode_graphs=self.decode_graphs)
        #: where requests stop unless they ask ``ignore_eos`` (config.json + generation_config.json)
        self.eos_token_ids: tuple[int, ...] = m.eos_token_ids
        #: ``SamplingParams.structured_outputs``: grammars and per-request matchers; the runner masks with them
        #: (:mod:`hybridkv.engine.structured`; the checkpoint's tokenizer unless the text front sets its own)
        self.structured = StructuredOutputs(m.vocab_size, self.eos_token_ids,
                                            lambda: checkpoint_tokenizer(m.source, m.vocab_size))
        self.runner.structured = self.structured
        self._ids = itertools.count()
        self._progress: dict[str, Progress] = {}
        self._usage = UsageTracker((g.spec for g in self.grouping.groups), (len(g.layers) for g in self.grouping.groups))

    # --------------------------------------------------------------- requests
    def add_request(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams | None = None, request_id: str | None = None,
        share_key: str | None = None,
    ) -> str:
        """Queue a prompt; returns its request id. Bad input raises before anything is queued.
        ``share_key``: whose share of the running slots it takes (:mod:`hybridkv.scheduler.shares`:
        one HTTP request's prompts, one client's requests); None, its own.

        One request is one sequence: ``sampling.n`` must be 1 (the text fronts queue ``n``
        requests of the prompt, one after another: see :meth:`SamplingParams.samples`)."""
        prompt = list(prompt_token_ids)
        check_token_ids(prompt, self.model.vocab_size)
        if not prompt:
            raise InvalidArgumentError("the prompt is empty")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise InvalidArgumentError(f"sampling must be a SamplingParams, got {sampling!r:.60}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(rid, str):
            raise InvalidArgumentError(f"a request id must be a str, got {rid!r:.60}")
        sampling = (sampling or SamplingParams()).with_eos(self.eos_token_ids)
        sampling.check_vocab(self.model.vocab_size)
        if sampling.n != 1:
            raise InvalidArgumentError(f"an engine request is one sequence; got n={sampling.n} (add n requests "
                                       "of the prompt: SamplingParams.samples())", param="n")
        so = sampling.structured_outputs
        matcher = None if so is None else self.structured.matcher(so)  # a bad grammar raises here
        self.scheduler.add_request(rid, prompt, sampling, share_key=share_key)
        if matcher is not None:
            self.structured.start(rid, matcher, sampling)
        self._progress[rid] = Progress(time.perf_counter(), sampling.prompt_logprobs is not None)
        return rid

    def abort_request(self, request_id: str) -> RequestOutput:
        """End a queued or running request now (its blocks freed at once); its output so far,
        finish reason ``"aborted"``. An id that is not queued or running: UnknownRequestError."""
        seq = self.scheduler.sequences.get(request_id) if isinstance(request_id, str) else None
        if seq is None:
            raise UnknownRequestError(f"request {request_id!r} is not queued or running")
        self.scheduler.abort_request(request_id)
        return self._output(seq, time.perf_counter())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _output(self, seq: Seq, now: float, error: str | None = None) -> RequestOutput:
        """The finished ``seq``'s output; forgets its progress."""
        r = seq.request
        progress = self._progress.pop(r.request_id)
        self.structured.drop(r.request_id)
        return RequestOutput(
            r.request_id,
            tuple(r.all_token_ids[: r.num_prompt_tokens]),
            tuple(r.output_token_ids),
            (seq.finish_reason or FinishReason.LENGTH).value,
            seq.num_cached_tokens,
            seq.num_preemptions,
            progress.arrival_time,
            progress.first_token_time,
            now,
            seq.arrival_hit_tokens,
            seq.last_hit_tokens,
            error,
            progress.prompt_logprobs,
        )

    def step_deltas(self, on_scheduled: Callable[[], None] | None = None) -> list[RequestDelta]:
        """One scheduler step through the model: per request that gained tokens (or finished)
        in it, the new token ids and, if it finished, its output (in schedule order).

        ``on_scheduled`` is called once the step is scheduled, before the model runs: the
        step's KV cache events (its evictions and newly cached blocks) are all known then,
        and a server publishes them a model step earlier than after the step."""
        sched = self.scheduler
        output = sched.schedule()
        if on_scheduled is not None:
            on_scheduled()
        for sr in output.scheduled:  # admitted this step: count its prefix hit once
            seq = sched.sequences[sr.request_id]
            if seq.admitted_step == output.step:
                self._usage.prefix_hit_tokens += seq.last_hit_tokens
        self.kv.pool_usage()  # this step's slots allocated: the core raises its peaks
        wanted = self._prompts_to_score(output)
        try:
            if not output.scheduled:
                sampled = {}
            else:
                sampled = self.runner.execute(output, wanted) if wanted else self.runner.execute(output)
        except Exception as exc:
            return self._roll_back(output, exc)
        for rid, (first, values) in (self.runner.last_prompt_logprobs.items() if wanted else ()):
            scores = self._progress[rid].scores
            scores.update(zip(range(first, first + len(values)), values))
        faults = self.runner.row_faults
        finished = {seq.request_id: seq for seq in sched.update_from_output(output, sampled, faults)}
        if len(self.structured):  # feed the matchers their tokens; end the requests whose grammar ended
            self.structured.advance(sched, sampled, finished)
        now = time.perf_counter()
        deltas = []
        for sr in output.scheduled:
            if not sr.sample and sr.request_id not in finished:
                continue
            seq = finished.get(sr.request_id) or sched.sequences.get(sr.request_id)
            if seq is None:
                continue
            progress = self._progress[sr.request_id]
            ids = seq.request.output_token_ids
            new = tuple(ids[progress.reported :])
            if new and progress.first_token_time is None:
                progress.first_token_time = now
            progress.reported = len(ids)
            scored = None
            if new and progress.scores is not None:  # the prompt is scored: hand its values over once
                scored = progress.prompt_logprobs = prompt_scores(seq.request_id, seq.request.num_prompt_tokens, progress.scores)
                progress.scores = None
            done = None
            if sr.request_id in finished:
                why = self.structured.errors.get(sr.request_id) or (NOT_NUMBERS if sr.request_id in faults else None)
                done = self._output(seq, now, why)
            if new or done is not None:
                deltas.append(RequestDelta(sr.request_id, new, done, scored))
        if not sched.has_unfinished_requests():  # idle: torch gets the cores back (a quantized decode lent them out)
            cpu_ops.hold_cores(False)
        return deltas

    def _prompts_to_score(self, output) -> dict[str, tuple[int, Sequence[int]]] | None:
        """The step's requests whose prompt positions are to be scored: id -> (k, prompt ids)."""
        wanted = None
        progress = self._progress
        for sr in output.scheduled:
            if progress[sr.request_id].scores is None:
                continue
            seq = self.scheduler.sequences[sr.request_id]
            req = seq.request
            if sr.num_computed_tokens < req.num_prompt_tokens - 1:
                wanted = wanted or {}
                wanted[sr.request_id] = (seq.sampling.prompt_logprobs, req.all_token_ids[: req.num_prompt_tokens])
        return wanted

    def _roll_back(self, output, exc: Exception) -> list[RequestDelta]:
        """The step's model run raised: undo it (the scheduler's rule), end what it found at fault."""
        ended = self.scheduler.roll_back(output)
        why = f"the model failed on this request ({type(exc).__name__}: {exc})"[:300]
        if ended:
            log.error("step %d failed on request %s alone; ending it: %s", output.step, ended[0].request_id,
                      why, exc_info=exc)
        else:
            log.warning("step %d failed (%s: %s); recomputing its %d requests one at a time", output.step,
                        type(exc).__name__, exc, len(output.scheduled))
        now = time.perf_counter()
        deltas = [RequestDelta(seq.request_id, (), self._output(seq, now, why)) for seq in ended]
        if not self.scheduler.has_unfinished_requests():
            cpu_ops.hold_cores(False)
        return deltas

    def step(self) -> list[RequestOutput]:
        """One scheduler step through the model; the requests that finished in it."""
        return [d.output for d in self.step_deltas() if d.output is not None]

    def generate(
        self,
        prompts: Iterable[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        max_steps: int = 1_000_000,
    ) -> list[RequestOutput]:
        """Run prompts to completion (batched through the scheduler); outputs in prompt order.
        Requests added before (``add_request``) run along; their outputs are not returned."""
        prompts = [list(p) for p in prompts]
        if isinstance(sampling, SamplingParams) or sampling is None:
            params = [sampling or SamplingParams()] * len(prompts)
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise InvalidArgumentError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        outputs: dict[str, RequestOutput] = {}
        steps = 0
        while self.has_unfinished_requests():
            if steps >= max_steps:
                raise InvalidArgumentError(f"not finished after {max_steps} steps")
            outputs.update((o.request_id, o) for o in self.step())
            steps += 1
        return [outputs[rid] for rid in ids]

    # ------------------------------------------------------------------ stats
    def kv_summary(self, num_tokens: int | None = None) -> KVSummary:
        """Blocks in use per group (now and peak), prefix-hit tokens and preemptions since the
        engine started, and the KV bytes of one request of ``num_tokens`` (default
        ``max_model_len``) in this layout and in the all-full one (state blocks included,
        and also given apart)."""
        n = self.max_model_len if num_tokens is None else num_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= self.max_model_len:
            raise InvalidArgumentError(f"num_tokens must be an int in [1, {self.max_model_len}], got {n!r}")
        u, usage = self._usage, self.kv.pool_usage()
        return KVSummary(
            hybrid=self.config.hybrid,
            groups=u.groups(usage),
            bytes_per_block=self.grouping.bytes_per_block,
            peak_blocks=usage.peak_used,
            prefix_hit_tokens=u.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_tokens=n,
            kv_bytes_per_request=kv_bytes_per_request(self.grouping, n),
            full_kv_bytes_per_request=kv_bytes_per_request(self.full_grouping, n),
            state_bytes_per_request=state_bytes_per_request(self.grouping, n),
            full_state_bytes_per_request=state_bytes_per_request(self.full_grouping, n),
        )

    @property
    def last_logits(self) -> dict[str, torch.Tensor]:
        """Logits of the last step, per request that sampled (for tests)."""
        return self.runner.last_logits
