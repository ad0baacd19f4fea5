"""Structured outputs' decode cost: per-token decode time with a JSON schema vs without, same tokens.

    python3 benchmarks/bench_structured.py [--model smollm2-135m] [--quantization int8] [--batches 1,32]
                                           [--rounds 3] [--threads 2] [--max-tokens 160]

One engine (``LLM``, ``--quantization``, default int8) on ``--model``; per batch size B, B chat
prompts asking for an employee record under a fixed schema of six fields (a bounded string, a
bounded integer, a bounded number, an enum, an array of bounded strings, a boolean), greedy:

* ``json``: ``SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))``; each
  request ends at EOS once its object is complete (its token count is what the free lane copies);
* ``free``: the same prompts without a schema, ``ignore_eos`` and ``max_tokens`` = the json
  request's token count, so both lanes generate exactly the same number of tokens per request
  and the batch shrinks at the same steps.

Only decode is timed: the steps after every request of the batch has its first token (the
prefill steps, and the first structured step's grammar compile, are outside the clock; the
grammar is compiled once before the rounds). Per-token decode time = decode seconds / decode
tokens (all rows); the lanes alternate, their order swapped round by round, after a warm-up
round. Printed per batch size: the median per-token time of each lane and the ratio free /
json (1.0x: the schema costs nothing; the target is >= 0.9x), median and range over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _paths  # noqa: E402,F401  (this checkout's src importable)

from hybridkv.engine.engine import EngineConfig  # noqa: E402
from hybridkv.engine.llm import LLM  # noqa: E402
from hybridkv.sampling_params import SamplingParams  # noqa: E402
from hybridkv.structured_outputs import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 70},
        "salary": {"type": "number", "minimum": 1000, "maximum": 99999},
        "department": {"enum": ["sales", "engineering", "finance", "legal", "support"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "salary", "department", "skills", "active"],
    "additionalProperties": False,
}
ROLES = ["a sales manager", "a backend engineer", "an accountant", "a lawyer", "a support agent", "a designer",
         "a data scientist", "an intern"]


def prompts(llm: LLM, batch: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": f"Write a JSON record for employee #{i + 1}, {ROLES[i % len(ROLES)]}."}]
             for i in range(batch)]
    return [llm.encode(c) for c in chats]


def decode_time(llm: LLM, ids: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, list[int]]:
    """(decode seconds, decode tokens, tokens per request): the steps after every request's first token."""
    engine = llm.engine
    rids = [engine.add_request(p, sp) for p, sp in zip(ids, params)]
    counts = dict.fromkeys(rids, 0)
    started = None
    timed_tokens = 0
    while engine.has_unfinished_requests():
        deltas = engine.step_deltas()
        if started is not None:
            timed_tokens += sum(len(d.new_token_ids) for d in deltas)
        for d in deltas:
            counts[d.request_id] += len(d.new_token_ids)
        if started is None and all(counts.values()):
            started = time.perf_counter()
    seconds = time.perf_counter() - started if started is not None else 0.0
    return seconds, timed_tokens, [counts[r] for r in rids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default="int8", help="int8, int4 or none")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    quant = None if args.quantization == "none" else args.quantization
    llm = LLM(args.model, EngineConfig(quantization=quant, max_model_len=1024, max_num_seqs=64))
    schema = StructuredOutputsParams(json=SCHEMA)
    llm.engine.structured.matcher(schema)  # the tokenizer and the grammar built once, off the clock
    print(f"{args.model} ({args.quantization}), {args.threads} threads, {args.rounds} rounds after a warm-up")
    for batch in (int(b) for b in args.batches.split(",")):
        ids = prompts(llm, batch)
        constrained = [SamplingParams(max_tokens=args.max_tokens, structured_outputs=schema)] * batch
        _, _, lengths = decode_time(llm, ids, constrained)  # warm-up, and the token counts to copy
        free = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
        decode_time(llm, ids, free)
        per = {"json": [], "free": []}
        for r in range(args.rounds):
            lanes = [("json", constrained), ("free", free)]
            for name, params in (lanes if r % 2 == 0 else lanes[::-1]):
                seconds, tokens, got = decode_time(llm, ids, params)
                assert got == lengths, f"{name}: token counts changed ({got} vs {lengths})"
                per[name].append(seconds / max(tokens, 1))
        ratios = [f / j for f, j in zip(per["free"], per["json"])]
        print(f"batch {batch:>3}: {sum(lengths)} tokens ({min(lengths)}..{max(lengths)} per request); per-token decode "
              f"json {statistics.median(per['json']) * 1e3:.2f} ms, free {statistics.median(per['free']) * 1e3:.2f} ms; "
              f"free/json {statistics.median(ratios):.3f}x (range {min(ratios):.3f}..{max(ratios):.3f}; target >= 0.9x)")


if __name__ == "__main__":
    main()
