"""Runs one :class:`~hybridkv.scheduler.interface.SchedulerOutput` on a model.

The runner is stateless between steps: everything a step needs (tokens,
positions, block tables per group) is in the scheduler output, and the KV lives in
the :class:`PagedKVStorage`. A step:

1. flattens the scheduled requests into ``T`` tokens (varlen, request order);
2. builds :class:`AttentionMetadata` (slot mappings per group; the attention plans
   its layouts from it once per step and attention type);
3. runs the model - the last layer's attention queries and MLP, and the logits, only
   at the last token of each request with ``sample=True`` - and samples one token per
   such request (all greedy rows in one ``argmax``).

``last_logits`` keeps those logits (``{request_id: [vocab]}``) for tests. A request whose
logits are a model fault (``nan``, ``+inf``, nothing above ``-inf``: see
:mod:`hybridkv.engine.sampling`) gets no token; it is in ``row_faults`` until the next step.
A request with a grammar samples under its token mask (``structured``:
:mod:`hybridkv.engine.structured`); a matcher in an error state makes its row a fault row.

A model with linear-attention layers (Qwen3-Next, Qwen3.5) runs with a
:class:`~hybridkv.engine.state_runner.StateRunner`: its state groups' tables become the
step's state metadata, the other groups' the attention's (the storage holds only those).
Without one, nothing of this runs.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Mapping, Sequence

import torch

from hybridkv.core.specs import KVCacheSpec
from hybridkv.engine.attention.metadata import AttentionMetadata
from hybridkv.engine.attention.decode_graphs import DecodeGraphs
from hybridkv.engine.attention.registry import get_backend
from hybridkv.engine.host_tensors import PinnedStager, long_tensor
from hybridkv.engine.kv_storage import PagedKVStorage
from hybridkv.engine.models.base import CausalLM
from hybridkv.engine.prompt_logprobs import chunk_targets, prompt_logprobs as score_prompt
from hybridkv.engine.sampling import FAULT, Sampler
from hybridkv.engine.state_runner import StateRunner
from hybridkv.engine.structured import StructuredOutputs
from hybridkv.errors import InvalidArgumentError, InvalidConfigError
from hybridkv.scheduler.interface import SchedulerOutput

__all__ = ["PagedModelRunner"]


def _check_group_specs(
    model: CausalLM, storage: PagedKVStorage, group_specs: Sequence[KVCacheSpec] | None
) -> tuple[KVCacheSpec, ...]:
    """Each group's spec; every layer of a group must be covered by it
    (:meth:`~hybridkv.core.specs.KVCacheSpec.covers`: the group frees no key the layer reads).
    Without ``group_specs`` a group's spec is its layers' one spec (they must agree)."""
    own = model.kv_cache_specs(storage.block_size)
    if group_specs is None:
        group_specs = []
        for g, layers in enumerate(storage.groups):
            kinds = {model.attention_type(i) for i in layers}
            if len(kinds) != 1:
                raise InvalidConfigError(
                    f"KV cache group {g} mixes attention types {sorted(k.as_tuple() for k in kinds)}; "
                    "give the group's spec (group_specs) if one covers them all"
                )
            group_specs.append(own[layers[0]])
    group_specs = tuple(group_specs)
    if len(group_specs) != len(storage.groups):
        raise InvalidConfigError(f"{len(group_specs)} group specs for {len(storage.groups)} KV cache groups")
    for g, (spec, layers) in enumerate(zip(group_specs, storage.groups)):
        for i in layers:
            if not spec.covers(own[i]):
                raise InvalidConfigError(
                    f"KV cache group {g} ({spec.type_id}) frees keys that layer {i} "
                    f"({model.attention_type(i).as_tuple()}) attends to"
                )
    return group_specs


class PagedModelRunner:
    """A :class:`~hybridkv.scheduler.interface.ModelRunner` over a model and its paged KV.

    ``group_specs[g]`` is the spec group ``g``'s blocks are managed by; a group may hold
    layers of other attention types that spec covers (all-full ``--no-hybrid`` layout).
    """

    def __init__(
        self,
        model: CausalLM,
        storage: PagedKVStorage,
        seed: int = 0,
        group_specs: Sequence[KVCacheSpec] | None = None,
        states: StateRunner | None = None,
        attention_backend: str = "reference",
        decode_graphs: "DecodeGraphs | None" = None,
    ) -> None:
        kv_layers = set(storage.layer_to_group_position)
        linear = set(getattr(model, "linear_layers", ()))
        state_layers = set(states.layers) if states is not None else set()
        if state_layers != linear:
            raise InvalidConfigError(
                f"the state storage covers layers {sorted(state_layers)}, the model's linear-attention "
                f"layers are {sorted(linear)}"
            )
        if kv_layers & state_layers or kv_layers | state_layers != set(range(model.num_layers)):
            raise InvalidConfigError(
                f"the KV storage covers layers {sorted(kv_layers)} and the state storage {sorted(state_layers)}, "
                f"the model has layers 0..{model.num_layers - 1}"
            )
        if states is not None and len(states.attention_groups) != storage.num_groups:
            raise InvalidConfigError(
                f"{len(states.attention_groups)} attention groups beside the state groups, the KV storage "
                f"has {storage.num_groups}"
            )
        if (storage.num_kv_heads, storage.head_size) != (model.num_kv_heads, model.head_dim):
            raise InvalidConfigError(
                f"KV storage is {storage.num_kv_heads} heads x {storage.head_size}, "
                f"the model needs {model.num_kv_heads} x {model.head_dim}"
            )
        self.group_specs = _check_group_specs(model, storage, group_specs)
        self.model = model
        self.storage = storage
        self.states = states
        self.sampler = Sampler(seed)
        self.last_logits: dict[str, torch.Tensor] = {}
        #: the last step's requests whose logits were a model fault (no token sampled)
        self.row_faults: set[str] = set()
        #: the last step's prompt scores: request id -> (first position, [PromptLogprob])
        self.last_prompt_logprobs: dict[str, tuple[int, list]] = {}
        #: the engine's structured outputs: the token masks of the rows that have a grammar (None: none)
        self.structured: StructuredOutputs | None = None
        self.device = storage.device
        #: a step's ints reach a CUDA device through pinned memory, with no host synchronisation
        self.stager = PinnedStager(self.device) if self.device.type == "cuda" else None
        self._ints = self.stager.long_tensor if self.stager is not None else partial(long_tensor, device=self.device)
        #: a registered backend's name (resolved: :func:`~hybridkv.engine.attention.registry.resolve_backend`)
        self.attention_backend = attention_backend
        #: pure-decode steps over static padded buffers (CUDA graphs on CUDA); None: every step eager
        self.decode_graphs = decode_graphs
        if decode_graphs is not None and (not get_backend(attention_backend).decode_graphs or states is not None):
            raise InvalidConfigError("decode graphs need an attention backend that supports them (triton) and a "
                                     "model without state layers")

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, prompt_logprobs: Mapping[str, tuple[int, Sequence[int]]] | None = None
    ) -> dict[str, int]:
        """Compute the step; return request id -> sampled token for requests with ``sample``
        (but those of ``row_faults``). Anything else that goes wrong raises: the caller
        rolls the step back (:meth:`~hybridkv.scheduler.scheduler.Scheduler.roll_back`).

        ``prompt_logprobs``: request id -> (top ``k``, its prompt's token ids) for requests
        whose prompt positions this step computes are wanted (:mod:`~hybridkv.engine.prompt_logprobs`);
        then the last layer runs on every row of the step, and ``last_prompt_logprobs`` maps each
        such request to (its first scored position, the values)."""
        self.last_logits = {}
        self.row_faults = set()
        self.last_prompt_logprobs = {}
        if self.stager is not None:
            self.stager.reset()  # the last step's sampled ids were read: its copies are done
        reqs = output.scheduled
        if not reqs:
            return {}
        seen: set[str] = set()
        for r in reqs:
            if r.request_id in seen:
                raise InvalidArgumentError(f"request {r.request_id!r} is scheduled twice in step {output.step}")
            seen.add(r.request_id)
            if len(r.token_ids) == 0:
                raise InvalidArgumentError(f"request {r.request_id!r} is scheduled with no tokens")
        flat_ids = [t for r in reqs for t in r.token_ids]  # in [0, vocab): checked where they entered (add_request)
        sampled = [i for i, r in enumerate(reqs) if r.sample]
        states = self.states
        if states is None:
            tables = [r.block_ids for r in reqs]
        else:  # the KV storage holds the attention groups only
            tables = [[r.block_ids[g] for g in states.attention_groups] for r in reqs]
        scored = self._scored_rows(reqs, prompt_logprobs) if prompt_logprobs else []
        graphs = self.decode_graphs
        if graphs is not None and not scored and all(len(r.token_ids) == 1 and r.sample for r in reqs) and graphs.fits(
            len(reqs), max(len(t) for r in tables for t in r)
        ):
            logits = graphs.run(flat_ids, [r.num_computed_tokens for r in reqs], tables)  # [S, vocab]
            return self._sample(reqs, list(range(len(reqs))), logits)
        meta = AttentionMetadata.build(
            self.storage,
            [r.num_computed_tokens for r in reqs],
            [len(r.token_ids) for r in reqs],
            tables,
            output_seqs=None if scored else sampled,  # prompt scores need every row's hidden state
            backend=self.attention_backend,
            upload=self._ints,
        )
        input_ids = self._ints(flat_ids)  # [T]
        if states is None:
            hidden = self.model(input_ids, meta.positions, meta)  # [N, hidden]: sampled requests' last tokens
        else:
            hidden = self.model(input_ids, meta.positions, meta, states.step(reqs))
        if scored:  # hidden is [T, hidden]: score the prompt rows, then keep the sampled ones
            model = self.model
            for rid, first_row, position, targets, k in scored:
                rows = hidden[first_row : first_row + len(targets)]
                self.last_prompt_logprobs[rid] = (position, score_prompt(model.compute_logits, rows, targets, k,
                                                                         model.vocab_size))
            ends = list(itertools.accumulate(len(r.token_ids) for r in reqs))
            hidden = hidden.index_select(0, self._ints([ends[i] - 1 for i in sampled]))  # [N, hidden]
        if not sampled:
            return {}
        logits = self.model.compute_logits(hidden)  # [N, vocab]
        return self._sample(reqs, sampled, logits)

    @staticmethod
    def _scored_rows(reqs, wanted: Mapping[str, tuple[int, Sequence[int]]]) -> list[tuple[str, int, int, list[int], int]]:
        """(request id, its first row in the step, the first prompt position scored, the tokens
        scored, k) of each request of ``wanted`` whose chunk scores prompt positions."""
        out = []
        row = 0
        for r in reqs:
            want = wanted.get(r.request_id)
            if want is not None:
                k, prompt = want
                targets = chunk_targets(prompt, r.num_computed_tokens, len(r.token_ids))
                if targets:
                    out.append((r.request_id, row, r.num_computed_tokens + 1, targets, k))
            row += len(r.token_ids)
        return out

    def _sample(self, reqs, sampled: list[int], logits: torch.Tensor) -> dict[str, int]:
        """One token per request ``reqs[i]`` of ``sampled`` from its row of ``logits`` [N, vocab],
        after its bias, ``min_tokens`` and penalties (over its ``all_token_ids``: the sampler's
        :func:`~hybridkv.engine.penalties.apply_penalties`); ``last_logits`` keeps the model's
        logits. A ``logit_bias`` id outside the vocabulary raises InvalidArgumentError (the step
        is rolled back and that request ends with an error). Rows with a grammar sample under
        its mask (:meth:`StructuredOutputs.masks`)."""
        chosen = [reqs[i] for i in sampled]
        allowed = self.structured.masks(chosen) if self.structured is not None else None
        tokens = self.sampler.sample_rows(
            logits, [r.sampling for r in chosen], [r.num_output_tokens for r in chosen],
            [r.all_token_ids for r in chosen], [r.num_prompt_tokens for r in chosen], allowed=allowed,
        )
        result: dict[str, int] = {}
        for row, (r, token) in enumerate(zip(chosen, tokens)):
            if token == FAULT:
                self.row_faults.add(r.request_id)
                continue
            self.last_logits[r.request_id] = logits[row]
            result[r.request_id] = token
        return result
