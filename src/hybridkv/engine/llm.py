"""The text front: prompts as text or chat messages in, text out, over :class:`LLMEngine`.

    llm = LLM("gemma-3-270m")                                   # a name, a .gguf file or a model dir
    [out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    out.text, out.finish_reason, out.time_to_first_token
    for delta in llm.stream([[{"role": "user", "content": "Hi"}]], SamplingParams(stop=("\\n",))):
        print(delta.text, end="", flush=True)

A prompt is a ``str`` (encoded with the tokenizer's special tokens: Gemma's BOS), a chat
(a list of ``{"role", "content"}`` dicts, rendered with the tokenizer's chat template and
encoded with ``add_special_tokens=False``, as transformers' ``apply_chat_template``), or a
list of token ids. The tokenizer comes from the checkpoint (GGUF metadata, or the model
directory's ``tokenizer.json``); a directory without tokenizer files gets the byte-level
:class:`~hybridkv.tokenizer.ByteTokenizer` when its vocabulary holds 256 ids, else none
(token-id prompts only). A tokenizer with ids past the model's vocabulary is refused
at construction (:class:`~hybridkv.errors.TokenizerError`).

Text is detokenized incrementally (multi-byte characters and SentencePiece spaces come
out whole); ``SamplingParams.stop`` strings are matched on that text: the stop string and
what follows it are left out, the request is aborted in the engine at once (its blocks
freed) and finishes with ``"stop"``, as in vLLM. Requests stop at the model's EOS ids and
the tokenizer's (vLLM's rule) unless ``ignore_eos``. Bad prompts (empty, too long for
the model, a template that raises) raise typed errors before any request is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from hybridkv.engine.engine import EngineConfig, LLMEngine, RequestOutput
from hybridkv.engine.models.base import CausalLM
from hybridkv.errors import InvalidArgumentError
from hybridkv.sampling_params import SamplingParams, check_context
from hybridkv.tokenizer.prompts import Prompt, _need_tokenizer, checkpoint_tokenizer, encode_prompt

__all__ = ["LLM", "CompletionOutput", "TextDelta", "TextStream", "Prompt", "checkpoint_tokenizer", "encode_prompt"]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One prompt's result. ``text`` ends before a matched stop string; ``token_ids`` are
    every sampled token (the stop token of a ``stop_token_ids`` stop included)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS, a stop token or a stop string), "length", "aborted" or "error" (the model failed on it)
    num_cached_tokens: int
    num_preemptions: int
    time_to_first_token: float | None  # seconds from add to first token; None: no token
    stop_reason: str | int | None = None  # the matched stop string, or the stop token id
    #: with ``SamplingParams.prompt_logprobs``: None for the first prompt token, then each one's
    #: :class:`~hybridkv.engine.prompt_logprobs.PromptLogprob` (None otherwise)
    prompt_logprobs: tuple | None = None


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one prompt produced in one engine step: new text (possibly empty, while a
    multi-byte character or a possible stop string is held back) and new token ids;
    ``output`` is set in the prompt's last delta."""

    index: int  # the position of the prompt (of its sample, with n > 1) in the call
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    output: CompletionOutput | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None


class TextStream:
    """One request's text state: incremental detokenizer, stop-string matcher, output so far.
    (The server's engine thread keeps one per request too.)"""

    __slots__ = ("index", "rid", "prompt", "detok", "stops", "text", "stop_string")

    def __init__(self, index: int, rid: str, prompt: list[int], tokenizer: Any, sampling: SamplingParams) -> None:
        from hybridkv import tokenizer as tk

        self.index, self.rid, self.prompt = index, rid, prompt
        self.detok = None if tokenizer is None else tk.IncrementalDetokenizer(tokenizer, prompt)
        self.stops = tk.StopStringMatcher(sampling.stop) if sampling.stop and tokenizer is not None else None
        self.text: list[str] = []
        self.stop_string: str | None = None

    def feed(self, ids: Sequence[int], last: bool) -> tuple[str, bool]:
        """New text for ``ids`` (``last``: the request's final ids, flush what is held back);
        True when a stop string matched (the text ends before it)."""
        if self.detok is None:
            return "", False
        vocab = self.detok.tokenizer.vocab_size  # a model may have more rows than its tokenizer ids: no text
        new = self.detok.add([i for i in ids if i < vocab])
        if last:
            new += self.detok.flush()
        stopped = False
        if self.stops is not None:
            new, stopped = self.stops.feed(new)
            if stopped:
                self.stop_string = self.stops.stop
            elif last:
                new += self.stops.flush()
        self.text.append(new)
        return new, stopped


class LLM:
    """Text in, text out on one :class:`LLMEngine` (see the module docstring)."""

    def __init__(self, model: Any, config: EngineConfig = EngineConfig(), tokenizer: Any = None) -> None:
        source = model
        if isinstance(model, (str, Path)):
            from hybridkv.checkpoint.installed import resolve_model

            source = resolve_model(str(model))
        self.engine = LLMEngine(source, config)
        self.model: CausalLM = self.engine.model
        vocab = self.model.vocab_size
        if tokenizer is None:
            tokenizer = checkpoint_tokenizer(getattr(self.model, "source", None) or source, vocab)
        if tokenizer is not None:
            from hybridkv.tokenizer import check_vocab

            check_vocab(tokenizer, vocab)
        #: None: the model has no tokenizer (token-id prompts only)
        self.tokenizer = tokenizer
        self.engine.structured.set_tokenizer(tokenizer)  # grammars compile against this one
        eos = () if tokenizer is None else tuple(tokenizer.eos_token_ids)
        #: ids that end a request unless it asks ``ignore_eos``: the model's and the tokenizer's
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(self.engine.eos_token_ids + eos))

    # ---------------------------------------------------------------- prompts
    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids (see :func:`encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, self.model.vocab_size)

    def _tokenizer(self, what: str):
        return _need_tokenizer(self.tokenizer, what, self.model.vocab_size)

    def _sampling(self, sampling: SamplingParams | None) -> SamplingParams:
        sp = sampling or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise InvalidArgumentError(f"sampling must be a SamplingParams, got {sp!r:.60}")
        if sp.stop:
            self._tokenizer("a stop string")
        return sp.with_eos(self.eos_token_ids)

    # ---------------------------------------------------------------- running
    def stream(
        self, prompts: Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[TextDelta]:
        """Run ``prompts`` batched; an iterator of each prompt's new text as the engine produces it.
        With ``n`` > 1 a prompt's samples come in a row: sample ``j`` of prompt ``i`` is index
        ``i * n + j`` (each prompt's own ``n``, prompt after prompt).

        Every prompt is encoded and queued now, before the iterator is returned: a bad one
        raises here and none stays queued. Closing the iterator early aborts the prompts
        still running.
        """
        prompts = [prompts] if isinstance(prompts, (str, bytes)) else list(prompts)
        if not prompts:
            raise InvalidArgumentError("no prompts")
        if isinstance(sampling, SamplingParams) or sampling is None:
            params = [self._sampling(sampling)] * len(prompts)
        else:
            params = [self._sampling(s) for s in sampling]
            if len(params) != len(prompts):
                raise InvalidArgumentError(f"{len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]  # every template / tokenizer error before any request
        for ids, sp in zip(encoded, params):  # as serve: prompt + max_tokens must fit, never capped
            check_context(len(ids), sp.max_tokens, self.engine.max_model_len)
        streams: dict[str, TextStream] = {}
        try:
            index = 0
            for ids, sp in zip(encoded, params):
                for sample in sp.samples():  # n > 1: n requests of the prompt in a row
                    rid = self.engine.add_request(ids, sample)
                    streams[rid] = TextStream(index, rid, ids, self.tokenizer, sample)
                    index += 1
        except BaseException:
            for rid in streams:
                self.engine.abort_request(rid)
            raise
        return self._run(streams)

    def _run(self, streams: dict[str, TextStream]) -> Iterator[TextDelta]:
        try:
            while streams:
                if not self.engine.has_unfinished_requests():  # pragma: no cover - the engine lost a request
                    raise InvalidArgumentError(f"requests {sorted(streams)} ended without output")
                for d in self.engine.step_deltas():
                    s = streams.get(d.request_id)
                    if s is None:
                        continue  # a request someone else added to the engine
                    text, stopped = s.feed(d.new_token_ids, d.finished)
                    out = d.output
                    if stopped and out is None:  # stop it now: its blocks go back before the next step
                        out = self.engine.abort_request(d.request_id)
                    if out is not None:
                        del streams[d.request_id]
                        yield TextDelta(s.index, s.rid, text, d.new_token_ids, self.finish(s, out, stopped))
                    elif text or d.new_token_ids:
                        yield TextDelta(s.index, s.rid, text, d.new_token_ids)
        finally:
            for rid in streams:  # the caller stopped early (or an error): free what still runs
                self.engine.abort_request(rid)

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        """Run ``prompts`` batched to the end; one output per prompt (``n`` per prompt with
        ``n`` > 1, prompt after prompt), in prompt order."""
        outputs: dict[int, CompletionOutput] = {}
        for delta in self.stream(prompts, sampling):
            if delta.output is not None:
                outputs[delta.index] = delta.output
        return [outputs[i] for i in range(len(outputs))]

    def finish(self, s: TextStream, out: RequestOutput, stopped: bool) -> CompletionOutput:
        """The :class:`CompletionOutput` of a request that ended with ``out`` (``stopped``: on
        a stop string of ``s``, which then names it)."""
        reason, stop_reason = out.finish_reason, None
        if stopped:
            reason, stop_reason = "stop", s.stop_string
        elif reason == "stop" and out.output_token_ids:
            stop_reason = out.output_token_ids[-1]
        return CompletionOutput(
            request_id=out.request_id,
            text="".join(s.text),
            token_ids=out.output_token_ids,
            prompt_token_ids=out.prompt_token_ids,
            finish_reason=reason,
            num_cached_tokens=out.num_cached_tokens,
            num_preemptions=out.num_preemptions,
            time_to_first_token=out.time_to_first_token,
            stop_reason=stop_reason,
            prompt_logprobs=out.prompt_logprobs,
        )

    def __repr__(self) -> str:
        return f"LLM({getattr(self.model, 'source', None) or type(self.model).__name__}, hybrid={self.engine.config.hybrid})"

