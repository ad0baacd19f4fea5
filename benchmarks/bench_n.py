"""``n`` samples of one prompt on the hybrid cache: prompt tokens computed and KV blocks held.

    python3 benchmarks/bench_n.py [--model gemma-3-270m] [--n 8] [--prompt-len 1000] [--max-tokens 32]
                                  [--block-size 16] [--quantization int8]

One request with ``SamplingParams(n=N)`` through the ``LLM`` front (N requests of the prompt in a
row, seeds seed .. seed + N - 1) beside the same N samples as N requests with prefix caching off
(every sample computes the whole prompt: what sharing saves). Printed per run: the prompt tokens
the engine computed (counted at the runner: each scheduled chunk's tokens below its prompt's
end) against the bound ``P + N x block_size``, and per KV cache group its peak blocks against
``its blocks for the prompt + N x (its output blocks + 2)`` (a windowed / chunked group's
prompt blocks capped at its per-request bound). Exit 1 if a bound is broken. Deterministic:
counts, not timings (wall seconds are printed for reference).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import _paths  # noqa: E402,F401  (this checkout's src importable)

from hybridkv.core.specs import cdiv  # noqa: E402
from hybridkv.engine.engine import EngineConfig  # noqa: E402
from hybridkv.engine.llm import LLM  # noqa: E402
from hybridkv.scheduler import SamplingParams  # noqa: E402


def _run(args, caching: bool) -> tuple[int, list[tuple[str, int, int]], float]:
    llm = LLM(args.model, EngineConfig(block_size=args.block_size, enable_prefix_caching=caching,
                                       quantization=args.quantization, max_model_len=args.prompt_len + args.max_tokens + 8))
    engine = llm.engine
    vocab = engine.model.vocab_size
    prompt = [random.Random(0).randrange(10, vocab - 1) for _ in range(args.prompt_len)]
    computed = [0]
    real = engine.runner.execute

    def execute(output, *rest):
        for sr in output.scheduled:
            num_prompt = engine.scheduler.sequences[sr.request_id].request.num_prompt_tokens
            computed[0] += max(0, min(num_prompt, sr.num_computed_tokens + len(sr.token_ids)) - sr.num_computed_tokens)
        return real(output, *rest)

    engine.runner.execute = execute
    start = time.perf_counter()
    outs = llm.generate([prompt], SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=1,
                                                 ignore_eos=True))
    seconds = time.perf_counter() - start
    assert len(outs) == args.n and all(len(o.token_ids) == args.max_tokens for o in outs)
    bs = engine.block_size
    usage = engine.kv.pool_usage()
    budget = engine.config.max_num_batched_tokens
    groups = []
    for g, (spec, peak) in enumerate(zip((g.spec for g in engine.grouping.groups), usage.peak_per_group)):
        cap = spec.max_num_blocks(args.prompt_len + args.max_tokens, budget)
        bound = min(cdiv(args.prompt_len, bs), cap) + args.n * (cdiv(args.max_tokens, bs) + 2)
        groups.append((f"{g} {spec.kind}{'' if spec.attention_span is None else ' ' + str(spec.attention_span)}",
                       peak, bound))
    return computed[0], groups, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quantization", default=None, choices=(None, "int8", "int4"))
    args = p.parse_args()
    bound = args.prompt_len + args.n * args.block_size
    ok = True
    print(f"n={args.n}, prompt {args.prompt_len} tokens, {args.max_tokens} new each, block {args.block_size}, "
          f"model {args.model}")
    for caching in (True, False):
        computed, groups, seconds = _run(args, caching)
        label = "shared (prefix caching)" if caching else "apart (no prefix caching)"
        print(f"{label}: {computed} prompt tokens computed ({computed / args.prompt_len:.2f} x the prompt; bound "
              f"{bound}), {seconds:.1f} s")
        for name, peak, group_bound in groups:
            print(f"  group {name}: peak {peak} blocks (bound {group_bound})")
        if caching:
            ok &= computed <= bound and all(peak <= b for _, peak, b in groups)
    print("bounds met" if ok else "A BOUND IS BROKEN")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
