"""Structured outputs over llguidance: a grammar compiled once, a matcher per request, a
token mask per step for the rows that have one.

The engine owns one :class:`StructuredOutputs` (``LLMEngine.structured``); the runner reads it
at its sampling site. A request's life:

1. ``LLMEngine.add_request``: :meth:`StructuredOutputs.matcher` compiles the request's
   :class:`~hybridkv.structured_outputs.StructuredOutputsParams` (a bounded LRU keyed by the
   grammar's text: one compile per distinct grammar, then a cheap copy) and returns the
   request's own matcher, or raises InvalidArgumentError (param ``structured_outputs``) for a
   schema / regex / grammar that does not compile, before anything is queued. Once queued,
   :meth:`start` keeps the matcher under the request id.
2. Each step, in ``PagedModelRunner._sample``: :meth:`masks` fills one bitmask row per sampling
   request that has a matcher (llguidance's parallel fill) and the sampler applies it to those
   rows (:func:`mask_logits`: ``-inf`` outside the grammar) after the logit bias / min_tokens /
   penalties and before temperature, top-k and top-p, on both sampler paths. A constrained row
   can only draw a token its grammar allows. A step with no matcher in it pays one dict check.
3. After the step, in ``LLMEngine.step_deltas`` once ``Scheduler.update_from_output`` appended
   the tokens: :meth:`advance` feeds each still-running request its sampled token. Only
   appended tokens are fed: a step that raised was rolled back before this point (nothing
   consumed), a fault row got no token. A preempted request keeps its output tokens and
   recomputes them without sampling them again, so its matcher (which consumed exactly those)
   stays valid; its next sampled token is the next one the matcher sees.
4. Ending: a finished grammar leaves only EOS in the mask (llguidance's rule), so the request
   stops at EOS like any other (``"stop"``, the EOS id its last token). Where EOS cannot end it
   (``ignore_eos``, a model without EOS, or ``min_tokens`` still holding EOS back) the EOS bits
   are cleared from its mask while anything else is allowed, and the request is ended with
   ``"stop"`` as soon as its matcher is stopped (aborted through the scheduler, its finish
   reason then set to ``"stop"``). A matcher in llguidance's error state (a resource limit
   hit, a token it refused), or one no token of the vocabulary can continue, ends that
   request alone with ``"error"`` (a fault row: no token): :attr:`errors` says why
   (``RequestOutput.error``). Every way a request ends drops its matcher (``LLMEngine._output``).

The tokenizer llguidance needs is built once per (tokenizer, vocabulary size, EOS ids) from
the vocabulary's own bytes (:func:`~hybridkv.tokenizer.token_bytes.token_bytes`); ids past the
tokenizer's (a padded model vocabulary) have no bytes and are never allowed. Without the
``llguidance`` package a structured request is an InvalidArgumentError naming the extra.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hybridkv.errors import InvalidArgumentError, TokenizerError
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.sequence import FinishReason, SequenceStatus
from hybridkv.structured_outputs import StructuredOutputsParams

__all__ = ["INSTALL", "StructuredOutputs", "banned_numpy", "banned_torch", "grammar_text", "ll_tokenizer", "mask_logits"]

PARAM = "structured_outputs"
INSTALL = "structured outputs need llguidance: pip install 'hybridkv[structured]'"
#: distinct compiled grammars kept per engine (a compile is ~1-5 ms; a copy of one ~10 µs)
CACHE_SIZE = 128
_ERROR_CHARS = 400
_UNSET = object()
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()
_EXECUTOR: list = []


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise InvalidArgumentError(INSTALL, param=PARAM) from None
    return llguidance


class _Vocab:
    """What ``llguidance.TokenizerWrapper`` reads: bytes per id, EOS, BOS, special ids, and an
    encoder whose ids spell exactly the bytes it is given (llguidance trusts it for forced bytes)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: int) -> None:
        from hybridkv.tokenizer.token_bytes import TokenSpeller, token_bytes

        self.tokens = token_bytes(tokenizer, vocab_size)
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(i for i in tokenizer.special_token_ids if i < vocab_size)
        self._spell = TokenSpeller(tokenizer, self.tokens, self.special_token_ids)

    def __call__(self, data: bytes) -> list[int]:
        return self._spell(data)


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> tuple[Any, tuple[int, ...]]:
    """(llguidance's ``LLTokenizer`` for ``tokenizer`` over ``vocab_size`` ids, its EOS ids);
    cached per tokenizer object. Without EOS ids the first id with no bytes stands in (the
    engine never lets it be sampled while anything else is allowed). InvalidArgumentError
    (param ``structured_outputs``) for a tokenizer whose bytes cannot be read."""
    llg = _llguidance()
    eos = tuple(dict.fromkeys(t for t in eos_token_ids if 0 <= t < vocab_size))
    key = (vocab_size, eos)
    with _TOKENIZERS_LOCK:
        try:
            cached = _TOKENIZERS.setdefault(tokenizer, {})
        except TypeError:  # not weakly referable: built each time
            cached = {}
        hit = cached.get(key)
        if hit is not None:
            return hit
        try:
            vocab = _Vocab(tokenizer, vocab_size, eos[0] if eos else 0)
        except TokenizerError as exc:
            raise InvalidArgumentError(f"structured outputs are not supported for this tokenizer: {exc}",
                                       param=PARAM) from None
        if not eos:
            eos = (next((i for i, b in enumerate(vocab.tokens) if not b), vocab_size - 1),)
            vocab.eos_token_id = eos[0]
        built = (llg.LLTokenizer(llg.TokenizerWrapper(vocab), eos_token=list(eos)), eos)
        cached[key] = built
        return built


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params`` (JSON text; not yet compiled)."""
    llg = _llguidance()
    M = llg.LLMatcher
    kind = params.kind
    if kind in ("json", "json_object"):
        options: dict[str, Any] = {}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        if params.disable_any_whitespace:
            options["whitespace_flexible"] = False
        schema = params.json if kind == "json" else '{"type":"object"}'
        try:
            return M.grammar_from_json_schema(schema, overrides=options or None)
        except ValueError as exc:
            raise InvalidArgumentError(f"structured_outputs: json is not a valid schema ({exc})"[:_ERROR_CHARS],
                                       param=PARAM) from None
    if kind == "regex":
        return M.grammar_from_regex(params.regex)
    if kind == "choice":
        return llg.grammar_from("choice", list(params.choice))
    return M.grammar_from_lark(params.grammar)


class _Row:
    __slots__ = ("matcher", "eos_stops", "min_tokens")

    def __init__(self, matcher: Any, eos_stops: bool, min_tokens: int) -> None:
        self.matcher = matcher
        self.eos_stops = eos_stops  # one of llguidance's EOS ids is among the request's stop ids
        self.min_tokens = min_tokens

    def eos_ends(self, num_output_tokens: int) -> bool:
        """Whether a sampled EOS would end the request now."""
        return self.eos_stops and num_output_tokens >= self.min_tokens


class StructuredOutputs:
    """The engine's grammars and per-request matchers (see the module docstring).

    ``load_tokenizer`` gives the model's tokenizer (or None) the first time one is needed,
    unless :meth:`set_tokenizer` gave it (the text front does). :meth:`matcher` may run on
    any thread (the server compiles there first, to refuse a bad schema with a 400); the
    per-request methods run on the engine's.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], load_tokenizer: Callable[[], Any],
                 cache_size: int = CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self._model_eos = tuple(eos_token_ids)
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = _UNSET
        self._ll: Any = None
        self._eos: tuple[int, ...] = ()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._rows: dict[str, _Row] = {}
        #: request id -> why its matcher failed (its ``RequestOutput.error``), until it is dropped
        self.errors: dict[str, str] = {}

    def set_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer grammars are compiled against (None: the model has none)."""
        with self._lock:
            self._tokenizer, self._ll = tokenizer, None
            self._cache.clear()

    def __len__(self) -> int:
        """Requests holding a matcher."""
        return len(self._rows)

    # ---------------------------------------------------------------- compile
    def _ll_tokenizer(self) -> Any:
        """llguidance's tokenizer (built on first use); call with the lock held."""
        if self._ll is None:
            if self._tokenizer is _UNSET:
                self._tokenizer = self._load_tokenizer()
            tok = self._tokenizer
            if tok is None:
                raise InvalidArgumentError("structured outputs need a tokenizer; this model has none", param=PARAM)
            self._ll, self._eos = ll_tokenizer(tok, self.vocab_size, (*tok.eos_token_ids, *self._model_eos))
        return self._ll

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher for ``params`` (compiled once per distinct grammar, then copied).
        InvalidArgumentError (param ``structured_outputs``) if it does not compile."""
        if not isinstance(params, StructuredOutputsParams):
            raise InvalidArgumentError(f"structured_outputs must be a StructuredOutputsParams, got {params!r:.60}",
                                       param=PARAM)
        llg = _llguidance()
        text = grammar_text(params)
        with self._lock:
            tok = self._ll_tokenizer()
            template = self._cache.get(text)
            if template is not None:
                self._cache.move_to_end(text)
                return template.deep_copy()
        template = llg.LLMatcher(tok, text, log_level=0)  # the compile: llguidance drops the GIL
        if template.is_error():
            why = " ".join(template.get_error().split())
            raise InvalidArgumentError(f"structured_outputs: the {params.kind} does not compile: {why}"[:_ERROR_CHARS],
                                       param=PARAM)
        with self._lock:
            self._cache[text] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return template.deep_copy()

    # ------------------------------------------------------------- requests
    def start(self, request_id: str, matcher: Any, sampling: SamplingParams) -> None:
        """Keep ``matcher`` (from :meth:`matcher`) for the queued request ``request_id``."""
        eos_stops = any(t in sampling.stop_token_ids for t in self._eos)
        self._rows[request_id] = _Row(matcher, eos_stops, sampling.min_tokens)

    def drop(self, request_id: str) -> None:
        """Forget a request that ended (no-op for one without a matcher)."""
        if self._rows.pop(request_id, None) is not None:
            self.errors.pop(request_id, None)

    def masks(self, reqs: Sequence[Any]) -> tuple[list[int], torch.Tensor] | None:
        """For the sampling requests ``reqs`` (``request_id``, ``num_output_tokens``): (the
        positions of those with a matcher, their allowed-token bitmask int32 [M, ceil(V / 32)],
        bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed); None when none
        has a matcher. A matcher in an error state, or one no token can continue, gets an
        all-zero row (the sampler's fault row: no token) and its reason in :attr:`errors`."""
        rows = self._rows
        if not rows:
            return None
        picked = [(i, rows[r.request_id], r) for i, r in enumerate(reqs) if r.request_id in rows]
        if not picked:
            return None
        llg = _llguidance()
        if not _EXECUTOR:
            _EXECUTOR.append(llg.LLExecutor())
        buf = np.empty((len(picked), (self.vocab_size + 31) // 32), dtype=np.int32)
        llg.numpy.fill_next_token_bitmask_par(_EXECUTOR[0], [(row.matcher, j) for j, (_, row, _) in enumerate(picked)],
                                              buf)
        words = buf.view(np.uint32)
        for j, (_, row, r) in enumerate(picked):
            if row.matcher.is_error():
                self.errors[r.request_id] = self._why(row.matcher)
                words[j] = 0
                continue
            if not row.eos_ends(r.num_output_tokens):
                kept = words[j].copy()
                for t in self._eos:
                    words[j, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
                if not words[j].any():  # only EOS is allowed (a grammar of the empty string): keep it
                    words[j] = kept
            if not words[j].any():  # a dead end: no token of the vocabulary spells what must come
                self.errors[r.request_id] = "structured outputs: no token of the vocabulary can continue the grammar"
        return [i for i, _, _ in picked], torch.from_numpy(buf)

    def advance(self, scheduler: Any, sampled: dict[str, int], finished: dict[str, Any]) -> None:
        """Feed each request that got a token in this step (``sampled``, appended by
        ``scheduler.update_from_output``) and is still running its token; end it (aborted in
        ``scheduler``, added to ``finished``) with ``"stop"`` when its grammar is complete and
        EOS cannot end it, or with ``"error"`` when its matcher refuses the token."""
        rows = self._rows
        for rid, token in sampled.items():
            row = rows.get(rid)
            if row is None or rid in finished:
                continue
            seq = scheduler.sequences.get(rid)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            m = row.matcher
            if not m.consume_token(token):
                self.errors[rid] = self._why(m)
                reason = FinishReason.ERROR
            elif m.is_stopped() and not row.eos_ends(seq.request.num_output_tokens):
                reason = FinishReason.STOP
            else:
                continue
            scheduler.abort_request(rid)
            seq.finish_reason = reason
            finished[rid] = seq

    @staticmethod
    def _why(matcher: Any) -> str:
        why = " ".join((matcher.get_error() or "the matcher stopped").split())
        return f"structured outputs: {why}"[:_ERROR_CHARS]


def mask_logits(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> a copy with ``-inf`` at every token row ``rows[j]`` may not take
    (bit clear in ``bitmask[j]``, int32 [M, ceil(V / 32)] on the host, as :meth:`StructuredOutputs.masks`
    gives it); the other rows as they are, ``logits`` untouched. Elementwise per row: a row's
    result does not depend on its batch."""
    num, vocab = logits.shape
    if logits.device.type == "cpu":
        banned = banned_numpy(bitmask, vocab)
    else:
        banned = banned_torch(bitmask.to(logits.device), vocab)
    if len(rows) == num:  # rows are ascending positions: all of them
        return logits.masked_fill(banned, float("-inf"))
    index = torch.tensor(list(rows), device=logits.device)
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))


def banned_numpy(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask int32 [M, W] on the host -> bool [M, vocab], True where the bit is clear (numpy
    unpacks the bits in one C loop; the words are little-endian, bit ``t % 32`` is token ``t``)."""
    packed = np.invert(bitmask.numpy().view(np.uint8))
    return torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab].view(np.bool_))


def banned_torch(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """:func:`banned_numpy` as tensor ops where ``bitmask`` is (a GPU)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab] == 0
