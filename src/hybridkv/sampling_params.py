"""How a request samples and when it stops, and whether it fits the context: the one
home of these rules (the engine, the scheduler, the server and the CLI import them).

Torch-free. A bad value is an InvalidArgumentError naming the parameter (``param``), which
the server reports in OpenAI's error body as it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Sequence

from hybridkv.errors import InvalidArgumentError, PromptTooLongError
from hybridkv.structured_outputs import StructuredOutputsParams

__all__ = ["GREEDY_BELOW", "LOGIT_BIAS_MAX", "MAX_LOGPROBS", "MAX_N", "PENALTY_MAX", "SEED_LIMIT", "SamplingParams",
           "check_context"]

#: the most samples of one prompt a request may ask for
MAX_N = 128

#: the most alternatives per position a request may ask for (vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20
#: a seed is an int in [0, SEED_LIMIT) (vLLM's range: 64 bits, unsigned); anything else is refused, never wrapped
SEED_LIMIT = 1 << 64

#: a temperature below this samples greedily (vLLM's ``_SAMPLING_EPS``): dividing logits by
#: less would only re-rank ties by rounding, and 1e-300 would overflow fp32
GREEDY_BELOW = 1e-5
#: ``presence_penalty`` and ``frequency_penalty`` lie in [-PENALTY_MAX, PENALTY_MAX] (OpenAI's, vLLM's)
PENALTY_MAX = 2.0
#: a ``logit_bias`` value lies in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (OpenAI's range)
LOGIT_BIAS_MAX = 100.0
_DIGITS = re.compile(r"[0-9]+")


def _real(x: Any) -> bool:
    """A real number that a float holds (a 400-digit int does not)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


def _bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as given (a mapping, (id, bias) pairs, or None) -> its (token id, bias)
    pairs sorted by id; InvalidArgumentError(param="logit_bias") for anything else."""
    def bad(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"logit_bias {why}, got {value!r:.80}", param="logit_bias")

    if value is None:
        return ()
    if isinstance(value, (str, bytes)):
        raise bad("must map token ids to biases")
    try:
        pairs = [tuple(pair) for pair in (value.items() if isinstance(value, Mapping) else value)]
    except TypeError:
        raise bad("must map token ids to biases") from None
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise bad("must map token ids to biases")
        key, bias = pair
        if isinstance(key, str) and _DIGITS.fullmatch(key):  # OpenAI's JSON keys: "50256"
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise bad("keys must be token ids (non-negative ints or their decimal strings)")
        if not _real(bias) or not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            raise bad(f"values must be numbers in [{-LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")
        if key in out:
            raise bad(f"names token id {key} twice")
        out[key] = float(bias)
    return tuple(sorted(out.items()))


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """The request's prompt and its ``max_tokens`` must fit ``max_model_len`` (OpenAI's and vLLM's
    rule: refused, never silently capped); the one rule of ``serve`` and of the text front
    (``LLM``, ``generate``). PromptTooLongError otherwise."""
    if prompt_len >= max_model_len:
        why = "exceeds" if prompt_len > max_model_len else "leaves no room for an output token within"
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; a prompt of {prompt_len} "
            f"tokens {why} max_model_len {max_model_len}"
        )
    if prompt_len + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion)"
        )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token, and when to stop. A temperature below :data:`GREEDY_BELOW`
    (0 included) is greedy (argmax); top-k and top-p always keep the most likely token.

    A request ends after ``max_tokens`` tokens or at the first sampled token in
    ``stop_token_ids`` (kept in the output, as vLLM and HF do). The scheduler knows no
    model, so it stops only at ``stop_token_ids``; the engine adds the model's EOS ids
    (:meth:`with_eos`) unless ``ignore_eos`` is set, which leaves ``stop_token_ids``
    in force (vLLM's defaults and meaning). ``stop`` strings end a request when its
    decoded text contains one; the text front (:class:`hybridkv.engine.llm.LLM`) applies
    them and leaves the stop string out of the text (vLLM's meaning); the scheduler
    and engine, which see token ids only, ignore them.

    Logit adjustments (vLLM's definitions and order; :mod:`hybridkv.engine.penalties` applies
    them to the raw logits before temperature, top-k and top-p, so greedy rows feel them too):

    - ``logit_bias``: token id -> bias in [-100, 100], added to that token's logit. Given as a
      mapping, (id, bias) pairs or None; a key is an int or, as OpenAI's JSON sends it, its
      decimal string (``{"50256": -100}``); kept as (id, bias) pairs sorted by id (hashable).
      The ids must lie in the model's vocabulary (:meth:`check_vocab`; the engine's sampler
      refuses one outside it with InvalidArgumentError(param="logit_bias")). -100 is a bias,
      not a ban: the token's logit stays finite. (vLLM clamps a value outside the range; here
      it is refused, as OpenAI does.)
    - ``min_tokens`` (0 to ``max_tokens``): until the request has that many output tokens, its
      ``stop_token_ids`` (the model's EOS ids among them after :meth:`with_eos`, unless
      ``ignore_eos``) get logit ``-inf``. Stop strings are not held back.
    - ``repetition_penalty`` (finite, > 0; 1 is off; vLLM's and HF's range): each token of the
      prompt or of the output so far has a positive logit divided by it, any other multiplied
      by it (> 1 discourages repeats, < 1 favours them).
    - ``frequency_penalty``, ``presence_penalty`` (in [-2, 2]; 0 is off): over the output tokens
      only, ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.

    Applied in that order (bias, min_tokens, repetition, frequency, presence). Their neutral
    values cost nothing: a step with none of them in force samples as if the fields did not exist.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    #: score the prompt: each prompt token's logprob and this many top alternatives (0..20; None:
    #: off; vLLM's ``prompt_logprobs``). Such a request computes its whole prompt (no prefix hit).
    prompt_logprobs: int | None = None
    #: samples per prompt (OpenAI's ``n``): the text fronts (``LLM``, ``serve``) make ``n``
    #: requests with seeds ``seed``, ``seed + 1``, ... sharing the prompt's computed blocks
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: (token id, bias) pairs sorted by id; given as a mapping (see the class docstring)
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    #: what the output must match (vLLM's ``structured_outputs``: a JSON schema, any JSON object, a
    #: regex, a choice or a grammar; None: free). The engine masks each step's disallowed tokens
    #: after the adjustments above, before temperature, top-k and top-p (:mod:`hybridkv.engine.structured`)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}", param="max_tokens")
        if not _real(self.temperature) or not 0 <= self.temperature < float("inf"):  # nan fails both comparisons
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                                       param="temperature")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be 0 (off) or a positive int, got {self.top_k!r}", param="top_k")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise InvalidArgumentError(f"seed must be an int in [0, 2**64), got {self.seed!r:.40}", param="seed")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            stop = (None,)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop):
            raise InvalidArgumentError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r:.80}",
                                       param="stop_token_ids")
        object.__setattr__(self, "stop_token_ids", stop)
        strings = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            strings = tuple(strings)
        except TypeError:
            strings = (None,)
        if any(not isinstance(t, str) or not t for t in strings):
            raise InvalidArgumentError(f"stop must be non-empty strings, got {self.stop!r:.80}", param="stop")
        object.__setattr__(self, "stop", tuple(dict.fromkeys(strings)))
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidArgumentError(f"n must be an int in [1, {MAX_N}], got {self.n!r}", param="n")
        k = self.prompt_logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
            raise InvalidArgumentError(f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {k!r}",
                                       param="prompt_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _real(value) or not -PENALTY_MAX <= value <= PENALTY_MAX:
                raise InvalidArgumentError(f"{name} must be a number in [-2, 2], got {value!r:.80}", param=name)
            object.__setattr__(self, name, float(value))
        rep = self.repetition_penalty
        if not _real(rep) or not 0 < rep < float("inf"):
            raise InvalidArgumentError(f"repetition_penalty must be a finite number > 0, got {rep!r:.80}",
                                       param="repetition_penalty")
        object.__setattr__(self, "repetition_penalty", float(rep))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        n = self.min_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"min_tokens must be an int >= 0, got {n!r:.80}", param="min_tokens")
        if n > self.max_tokens:
            raise InvalidArgumentError(f"min_tokens must be at most max_tokens={self.max_tokens}, got {n}",
                                       param="min_tokens")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            so = StructuredOutputsParams.from_dict(so)  # vLLM's dict form; InvalidArgumentError(param="structured_outputs")
            object.__setattr__(self, "structured_outputs", so)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether a repetition, frequency or presence penalty is on (they read the request's tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def check_vocab(self, vocab_size: int) -> None:
        """Every ``logit_bias`` id must be below ``vocab_size`` (vLLM's check): InvalidArgumentError
        (param="logit_bias") otherwise. ``stop_token_ids`` are not checked: an id outside the
        vocabulary is never sampled (nor held back by ``min_tokens``)."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:  # sorted: the last id is the largest
            outside = [t for t, _ in self.logit_bias if t >= vocab_size]
            raise InvalidArgumentError(
                f"logit_bias names token ids {outside[:8]}{' ...' if len(outside) > 8 else ''} outside the "
                f"vocabulary of {vocab_size} tokens", param="logit_bias",
            )

    def samples(self) -> list["SamplingParams"]:
        """The ``n`` one-sequence params of these (``n`` = 1 each; seeds ``(seed + i) mod 2**64`` when set),
        for ``n`` requests of one prompt queued in a row. The prompt is then computed once,
        through the prefix cache: the first request's prefill chunks use the whole step budget
        but the last, so the others are admitted in the step of its last chunk or later, and
        hit the blocks it caches at scheduling (a state group's checkpoint from the next step);
        each computes only what the hit leaves, at most a block (``num_hit`` is whole blocks of
        at most ``P - 1`` tokens). Admission counts the hit, as for any prefix hit."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % SEED_LIMIT) for i in range(self.n)]

    def with_eos(self, eos_token_ids: Sequence[int]) -> "SamplingParams":
        """These params with the model's EOS ids added to ``stop_token_ids`` (self if
        ``ignore_eos`` or nothing to add); the other fields kept (``min_tokens`` then holds the
        EOS ids back too)."""
        extra = tuple(t for t in dict.fromkeys(eos_token_ids) if t not in self.stop_token_ids)
        if self.ignore_eos or not extra:
            return self
        return replace(self, stop_token_ids=self.stop_token_ids + extra)
