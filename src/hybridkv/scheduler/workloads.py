"""Workloads for the simulator: seeded synthetic generators and a JSONL trace format.

A trace is a list of :class:`TraceRequest`. JSONL, one request per line::

    {"arrival": 0, "prompt": [1, 2, 3], "output_len": 16}
    {"arrival": 4, "prompt_len": 9000, "prefix_id": "sys-a", "prefix_len": 8192, "output_len": 128}

``prompt`` gives the token ids; otherwise ``prompt_len`` tokens are generated, the
first ``prefix_len`` of them shared by every request with the same ``prefix_id``.
``id`` is optional. Lines that are blank or start with ``#`` are skipped. A bad
line raises :class:`TraceFormatError` naming its line number.

Synthetic workloads (all seeded, so both layouts see the same requests):

* ``long-doc``: long documents behind a few shared system prompts of several chunks;
* ``chat``: multi-turn conversations, each turn's prompt is the previous turn's
  prompt + its output (as the fake runner produces it) + a new user message;
* ``sharegpt``: a ShareGPT-like mix of short and long prompts and outputs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from hybridkv.errors import InvalidArgumentError, TraceFormatError
from hybridkv.scheduler.fake_runner import fake_token

__all__ = ["TraceRequest", "WORKLOADS", "make_workload", "load_trace", "parse_trace_lines", "dump_trace"]

VOCAB = 32000


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


# ------------------------------------------------------------------ trace files
_KEYS = {"id", "arrival", "prompt", "prompt_len", "prefix_id", "prefix_len", "output_len"}


def _int_field(obj: dict, key: str, line: int, path: str | None, minimum: int, default: int | None = None) -> int:
    value = obj.get(key, default)
    if value is None:
        raise TraceFormatError(f"missing {key!r}", line, path)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(f"{key!r} must be an int >= {minimum}, got {value!r}", line, path)
    return value


def parse_trace_lines(lines: Iterable[str], path: str | None = None) -> list[TraceRequest]:
    """Parse JSONL trace lines (see the module docstring)."""
    out: list[TraceRequest] = []
    ids: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"not JSON: {exc.msg}", number, path) from None
        if not isinstance(obj, dict):
            raise TraceFormatError("each line must be a JSON object", number, path)
        unknown = set(obj) - _KEYS
        if unknown:
            raise TraceFormatError(f"unknown key(s) {sorted(unknown)}; expected {sorted(_KEYS)}", number, path)
        arrival = _int_field(obj, "arrival", number, path, 0, default=0)
        output_len = _int_field(obj, "output_len", number, path, 1)
        rid = obj.get("id", f"req-{len(out)}")
        if not isinstance(rid, str) or not rid:
            raise TraceFormatError(f"'id' must be a non-empty string, got {rid!r}", number, path)
        if rid in ids:
            raise TraceFormatError(f"duplicate id {rid!r}", number, path)
        if "prompt" in obj:
            prompt = obj["prompt"]
            if "prompt_len" in obj or "prefix_id" in obj:
                raise TraceFormatError("give either 'prompt' or 'prompt_len' (+ prefix), not both", number, path)
            if (
                not isinstance(prompt, list)
                or not prompt
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t for t in prompt)
            ):
                raise TraceFormatError("'prompt' must be a non-empty list of non-negative ints", number, path)
            tokens = list(prompt)
        else:
            plen = _int_field(obj, "prompt_len", number, path, 1)
            prefix_len = 0
            tokens = []
            if "prefix_id" in obj:
                prefix_id = obj["prefix_id"]
                if not isinstance(prefix_id, str):
                    raise TraceFormatError(f"'prefix_id' must be a string, got {prefix_id!r}", number, path)
                prefix_len = _int_field(obj, "prefix_len", number, path, 0)
                if prefix_len > plen:
                    raise TraceFormatError(f"prefix_len {prefix_len} > prompt_len {plen}", number, path)
                tokens = _prefix_tokens(prefix_id, prefix_len)
            elif "prefix_len" in obj:
                raise TraceFormatError("'prefix_len' needs a 'prefix_id'", number, path)
            tokens += _tokens(random.Random(f"body:{rid}:{number}"), plen - prefix_len)
        ids.add(rid)
        out.append(TraceRequest(rid, arrival, tuple(tokens), output_len))
    if not out:
        raise TraceFormatError("the trace holds no request", None, path)
    return sorted(out, key=lambda r: r.arrival_step)


def load_trace(path: str | Path) -> list[TraceRequest]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace_lines(f, str(path))
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace: {exc.strerror}", None, str(path)) from None


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
    for i in range(num_requests):
        prefix = systems[rng.randrange(len(systems))]
        output_len = rng.randint(64, 256)
        doc_len = rng.randint(chunk // 2, 6 * chunk)
        plen = min(sys_len + doc_len, max_model_len - output_len)
        tokens = _prefix_tokens(prefix, sys_len)[:plen] + _tokens(rng, max(plen - sys_len, 0))
        out.append(TraceRequest(f"doc-{i}", i // 2, tuple(tokens), output_len))
    return out


def multi_turn_chat(rng: random.Random, num_requests: int, max_model_len: int, chunk: int) -> list[TraceRequest]:
    """Conversations of up to 6 turns; turn t+1 extends turn t's prompt and output."""
    out: list[TraceRequest] = []
    conv = 0
    while len(out) < num_requests:
        history = _tokens(rng, rng.randint(200, 2000))  # system prompt + first message
        arrival = conv
        for turn in range(rng.randint(2, 6)):
            output_len = rng.randint(32, 400)
            if len(history) + output_len > max_model_len or len(out) >= num_requests:
                break
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
    step = 0.0
    for i in range(num_requests):
        output_len = max(1, min(int(rng.lognormvariate(5.3, 0.9)), 2048))
        plen = max(4, min(int(rng.lognormvariate(6.4, 1.2)), max_model_len - output_len))
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
    if num_requests < 1:
        raise InvalidArgumentError(f"num_requests must be >= 1, got {num_requests}")
    return gen(random.Random(seed), num_requests, max_model_len, chunk)
