"""Workloads for the simulator: seeded synthetic generators and a JSONL trace format.

A trace is a list of :class:`TraceRequest`; :data:`TRACE_FORMAT` (also shown by
``hybridkv simulate --help``) describes the JSONL file. A bad line raises
:class:`TraceFormatError` naming its line number, before any prompt is built: a
line is checked against ``max_model_len`` and :data:`MAX_ARRIVAL`, and the whole
trace against :data:`MAX_WORKLOAD_TOKENS`, before its tokens are made.

Synthetic workloads (all seeded, so both layouts see the same requests):

* ``long-doc``: long documents behind a few shared system prompts of several chunks;
* ``chat``: multi-turn conversations, each turn's prompt is the previous turn's
  prompt + its output (as the fake runner produces it) + a new user message;
* ``sharegpt``: a ShareGPT-like mix of short and long prompts and outputs.

Every generated request fits ``max_model_len`` (prompt + output; lengths drawn
longer are cut by :func:`_fit`), so every generator terminates for any
``max_model_len >= 2``.
"""

from __future__ import annotations

import json
import os
import random
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from hybridkv.errors import InvalidArgumentError, TraceFormatError
from hybridkv.scheduler.fake_runner import fake_token

__all__ = [
    "TraceRequest",
    "WORKLOADS",
    "TRACE_FORMAT",
    "MAX_ARRIVAL",
    "MAX_WORKLOAD_TOKENS",
    "make_workload",
    "load_trace",
    "parse_trace_lines",
    "dump_trace",
]

VOCAB = 32000
#: the latest arrival step a trace may name (the simulator's default step limit)
MAX_ARRIVAL = 1_000_000
#: prompt tokens a workload may hold in all (~36 bytes each as Python ints: ~1.2 GB)
MAX_WORKLOAD_TOKENS = 2**25

TRACE_FORMAT = f"""\
trace format (JSONL, one request per line; blank lines and lines starting with # are skipped):
  {{"arrival": 0, "prompt": [1, 2, 3], "output_len": 16}}
  {{"arrival": 4, "prompt_len": 9000, "prefix_id": "sys-a", "prefix_len": 8192, "output_len": 128}}
  arrival     scheduler step the request arrives at, int 0..{MAX_ARRIVAL:,} (default 0)
  prompt      the prompt's token ids, a non-empty list of ints >= 0; or instead:
  prompt_len  prompt length, int >= 1: that many seeded tokens are made, the first
              prefix_len of them shared by every request with the same prefix_id
  prefix_id   string naming a shared prefix (optional); prefix_len: int 0..prompt_len
  output_len  tokens to generate, int >= 1 (required)
  id          request id, a non-empty unique string (default req-N)
  a prompt may not exceed --max-model-len; the trace holds at most {MAX_WORKLOAD_TOKENS:,} prompt tokens"""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload: when it arrives (step), its prompt and output length."""

    request_id: str
    arrival_step: int
    prompt_token_ids: tuple[int, ...] = field(repr=False)
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _prefix_tokens(prefix_id: str, n: int) -> list[int]:
    return _tokens(random.Random(f"prefix:{prefix_id}"), n)


def _fit(prompt_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """(prompt_len, output_len) cut so that both are >= 1 and their sum <= ``max_model_len`` (>= 2).

    The prompt is cut first; an output that alone fills the context is halved first::

        _fit(3000, 100, 2048) -> (1948, 100)      _fit(300, 64, 16) -> (8, 8)
    """
    if output_len >= max_model_len:
        output_len = max(1, max_model_len // 2)
    return max(1, min(prompt_len, max_model_len - output_len)), output_len


class _TokenBudget:
    """Counts the prompt tokens a synthetic workload makes; refuses past MAX_WORKLOAD_TOKENS.

    After 32 of ``num_requests`` requests it extrapolates, so that a workload bound to
    exceed the budget by 2x is refused at once, not after making 33M tokens.
    """

    def __init__(self, what: str, num_requests: int):
        self.what = what
        self.num_requests = num_requests
        self.total = 0
        self.count = 0

    def take(self, n: int) -> None:
        self.total += n
        self.count += 1
        if self.total > MAX_WORKLOAD_TOKENS:
            raise InvalidArgumentError(f"{self.what} holds more than {MAX_WORKLOAD_TOKENS:,} prompt tokens; {_TOO_MANY}")
        if self.count == 32 and self.total * self.num_requests > 2 * MAX_WORKLOAD_TOKENS * self.count:
            about = self.total * self.num_requests // self.count
            raise InvalidArgumentError(
                f"{self.what} would hold about {about:,} prompt tokens; {_TOO_MANY}"
            )


_TOO_MANY = f"the simulator holds at most {MAX_WORKLOAD_TOKENS:,} (use fewer or shorter requests)"


# ------------------------------------------------------------------ trace files
_KEYS = {"id", "arrival", "prompt", "prompt_len", "prefix_id", "prefix_len", "output_len"}


def _int_field(obj: dict, key: str, line: int, path: str | None, minimum: int, default: int | None = None) -> int:
    value = obj.get(key, default)
    if value is None:
        raise TraceFormatError(f"missing {key!r}", line, path)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(f"{key!r} must be an int >= {minimum}, got {value!r}", line, path)
    return value


@dataclass(frozen=True, slots=True)
class _Line:
    """One checked trace line, its prompt not yet made (unless given as ids)."""

    number: int
    request_id: str
    arrival: int
    output_len: int
    prompt: tuple[int, ...] | None  # the ids of a "prompt" line
    prompt_len: int
    prefix_id: str | None = None
    prefix_len: int = 0

    def tokens(self) -> tuple[int, ...]:
        if self.prompt is not None:
            return self.prompt
        head = _prefix_tokens(self.prefix_id, self.prefix_len) if self.prefix_id is not None else []
        body = _tokens(random.Random(f"body:{self.request_id}:{self.number}"), self.prompt_len - self.prefix_len)
        return tuple(head + body)


def _decode(raw: str | bytes, number: int, path: str | None) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); a trace is JSONL", number, path
        ) from None


def _parse_line(text: str, number: int, path: str | None, default_id: str, max_model_len: int | None) -> _Line:
    def fail(message: str) -> TraceFormatError:
        return TraceFormatError(message, number, path)

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(f"not JSON: {exc.msg}") from None
    except RecursionError:
        raise fail("JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise fail("each line must be a JSON object")
    unknown = set(obj) - _KEYS
    if unknown:
        raise fail(f"unknown key(s) {sorted(unknown)}; expected {sorted(_KEYS)}")
    arrival = _int_field(obj, "arrival", number, path, 0, default=0)
    if arrival > MAX_ARRIVAL:
        raise fail(f"'arrival' {arrival:,} is past the last step simulated ({MAX_ARRIVAL:,})")
    output_len = _int_field(obj, "output_len", number, path, 1)
    rid = obj.get("id", default_id)
    if not isinstance(rid, str) or not rid or not _is_text(rid):
        raise fail(f"'id' must be a non-empty string of text, got {rid!r}")
    if "prompt" in obj:
        prompt = obj["prompt"]
        if "prompt_len" in obj or "prefix_id" in obj or "prefix_len" in obj:
            raise fail("give either 'prompt' or 'prompt_len' (+ prefix), not both")
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t for t in prompt)
        ):
            raise fail("'prompt' must be a non-empty list of non-negative ints")
        line = _Line(number, rid, arrival, output_len, tuple(prompt), len(prompt))
    else:
        plen = _int_field(obj, "prompt_len", number, path, 1)
        line = _Line(number, rid, arrival, output_len, None, plen)
        if "prefix_id" in obj:
            prefix_id = obj["prefix_id"]
            if not isinstance(prefix_id, str) or not _is_text(prefix_id):
                raise fail(f"'prefix_id' must be a string of text, got {prefix_id!r}")
            prefix_len = _int_field(obj, "prefix_len", number, path, 0)
            if prefix_len > plen:
                raise fail(f"prefix_len {prefix_len} > prompt_len {plen}")
            line = _Line(number, rid, arrival, output_len, None, plen, prefix_id, prefix_len)
        elif "prefix_len" in obj:
            raise fail("'prefix_len' needs a 'prefix_id'")
    if max_model_len is not None and line.prompt_len > max_model_len:
        raise fail(f"a prompt of {line.prompt_len:,} tokens exceeds max_model_len {max_model_len:,}")
    return line


def parse_trace_lines(
    lines: Iterable[str | bytes], path: str | None = None, *, max_model_len: int | None = None
) -> list[TraceRequest]:
    """Parse JSONL trace lines (:data:`TRACE_FORMAT`); bytes lines must be UTF-8.

    Every line is checked (with ``max_model_len``: no prompt longer) and the prompt
    tokens counted before any prompt is made.
    """
    checked: list[_Line] = []
    ids: set[str] = set()
    total = 0
    for number, raw in enumerate(lines, start=1):
        text = _decode(raw, number, path).strip()
        if not text or text.startswith("#"):
            continue
        line = _parse_line(text, number, path, f"req-{len(checked)}", max_model_len)
        if line.request_id in ids:
            raise TraceFormatError(f"duplicate id {line.request_id!r}", number, path)
        total += line.prompt_len
        if total > MAX_WORKLOAD_TOKENS:
            raise TraceFormatError(f"the trace holds more than {MAX_WORKLOAD_TOKENS:,} prompt tokens; {_TOO_MANY}",
                                   number, path)
        ids.add(line.request_id)
        checked.append(line)
    if not checked:
        raise TraceFormatError("the trace holds no request", None, path)
    out = [TraceRequest(x.request_id, x.arrival, x.tokens(), x.output_len) for x in checked]
    return sorted(out, key=lambda r: r.arrival_step)


def _is_text(value: str) -> bool:
    """False for strings JSON allows but UTF-8 cannot carry (a lone surrogate, ``"\\ud800"``)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def load_trace(path: str | Path, *, max_model_len: int | None = None) -> list[TraceRequest]:
    """Read a JSONL trace file (:func:`parse_trace_lines`); unreadable files raise TraceFormatError.

    Only a regular file is read: a FIFO or a device could block or never end."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise TraceFormatError("not a regular file", None, str(path))
        with open(path, "rb") as f:
            return parse_trace_lines(f, str(path), max_model_len=max_model_len)
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace: {exc.strerror or exc}", None, str(path)) from None


def dump_trace(requests: Iterable[TraceRequest]) -> str:
    """JSONL with explicit prompts (round-trips through :func:`parse_trace_lines`)."""
    return "".join(
        json.dumps({"id": r.request_id, "arrival": r.arrival_step, "prompt": list(r.prompt_token_ids), "output_len": r.output_len})
        + "\n"
        for r in requests
    )


# -------------------------------------------------------------------- synthetic
def long_documents(rng: random.Random, num_requests: int, max_model_len: int, chunk: int) -> list[TraceRequest]:
    """Documents of 1-6 chunks behind one of 3 system prompts of 2 chunks; 2 arrive per step."""
    systems = [f"system-{i}" for i in range(3)]
    sys_len = min(2 * chunk, max_model_len // 4)
    out = []
    budget = _TokenBudget(f"long-doc x{num_requests}", num_requests)
    for i in range(num_requests):
        prefix = systems[rng.randrange(len(systems))]
        output_len = rng.randint(64, 256)
        doc_len = rng.randint(chunk // 2, 6 * chunk)
        plen, output_len = _fit(sys_len + doc_len, output_len, max_model_len)
        budget.take(plen)
        tokens = _prefix_tokens(prefix, sys_len)[:plen] + _tokens(rng, max(plen - sys_len, 0))
        out.append(TraceRequest(f"doc-{i}", i // 2, tuple(tokens), output_len))
    return out


def multi_turn_chat(rng: random.Random, num_requests: int, max_model_len: int, chunk: int) -> list[TraceRequest]:
    """Conversations of up to 6 turns; turn t+1 extends turn t's prompt and output."""
    out: list[TraceRequest] = []
    budget = _TokenBudget(f"chat x{num_requests}", num_requests)
    conv = 0
    while len(out) < num_requests:  # each conversation adds >= 1 request: its first turn fits
        history = _tokens(rng, rng.randint(200, 2000))  # system prompt + first message
        arrival = conv
        for turn in range(rng.randint(2, 6)):
            output_len = rng.randint(32, 400)
            if turn == 0:
                plen, output_len = _fit(len(history), output_len, max_model_len)
                history = history[:plen]
            if len(history) + output_len > max_model_len or len(out) >= num_requests:
                break
            budget.take(len(history))
            rid = f"chat-{conv}-{turn}"
            out.append(TraceRequest(rid, arrival, tuple(history), output_len))
            reply = [fake_token(rid, k, VOCAB) for k in range(output_len)]
            history = history + reply + _tokens(rng, rng.randint(20, 600))
            arrival += output_len + rng.randint(5, 50)  # the user answers after the reply is done
        conv += 1
    return sorted(out, key=lambda r: r.arrival_step)


def sharegpt_like(rng: random.Random, num_requests: int, max_model_len: int, chunk: int) -> list[TraceRequest]:
    """Log-normal prompt (median ~600) and output (median ~200) lengths, ~1 arrival per step."""
    out = []
    budget = _TokenBudget(f"sharegpt x{num_requests}", num_requests)
    step = 0.0
    for i in range(num_requests):
        output_len = max(1, min(int(rng.lognormvariate(5.3, 0.9)), 2048))
        plen, output_len = _fit(max(4, int(rng.lognormvariate(6.4, 1.2))), output_len, max_model_len)
        budget.take(plen)
        out.append(TraceRequest(f"sg-{i}", int(step), tuple(_tokens(rng, plen)), output_len))
        step += rng.expovariate(1.0)
    return out


WORKLOADS: dict[str, Callable[[random.Random, int, int, int], list[TraceRequest]]] = {
    "long-doc": long_documents,
    "chat": multi_turn_chat,
    "sharegpt": sharegpt_like,
}


def make_workload(name: str, *, num_requests: int = 64, max_model_len: int = 131072, chunk: int = 8192, seed: int = 0) -> list[TraceRequest]:
    """A seeded synthetic workload; ``chunk`` sets the document scale (a model's chunk / window)."""
    try:
        gen = WORKLOADS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown workload {name!r}; expected one of {sorted(WORKLOADS)} or a .jsonl trace") from None
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise InvalidArgumentError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise InvalidArgumentError(
            f"max_model_len must be an int >= 2 for a workload (a prompt token and an output token), got {max_model_len!r}"
        )
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InvalidArgumentError(f"chunk must be an int >= 1, got {chunk!r}")
    return gen(random.Random(seed), num_requests, max_model_len, chunk)
