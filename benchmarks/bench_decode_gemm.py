"""The decode GEMM kernel (``HYBRIDKV_DECODE_GEMM``): our engine on Gemma 3 270M with each, side by side.

    PYTHONPATH=src python3 benchmarks/bench_decode_gemm.py [--rounds 3] [--max-prompt 384] [--max-output 32]

bench_real's workload (32 requests at once, seeded) through one loaded model; in every
round the two kernels run in turn (order alternating), each on a fresh engine, and the
tokens of the two must agree. Prints per round the total times and their ratio
(transposed / oneDNN: > 1 means oneDNN is faster), the median, and what
:func:`~hybridkv.engine.models.linear.decode_kernel` picks on this machine by itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _real_env import gemma_gguf, make_workload, use_repo_src  # noqa: E402

use_repo_src()

import torch  # noqa: E402

from bench_real import FULL, ours_engine, run_ours, tokenize_corpus  # noqa: E402
from hybridkv.engine.models import load_model, linear  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.pop("HYBRIDKV_DECODE_GEMM", None)
    linear.decode_kernel.cache_clear()
    print(f"decode_kernel() picks {linear.decode_kernel()!r} here by itself")
    path = gemma_gguf()
    corpus, bos = tokenize_corpus(path)
    lo_p, _ = FULL["prompt_range"]
    lo_o, _ = FULL["out_range"]
    w = make_workload(corpus, bos, FULL["n"], (min(lo_p, args.max_prompt), args.max_prompt),
                      (min(lo_o, args.max_output), args.max_output))
    model = load_model(path)
    print(f"{len(w.prompts)} requests, {w.prompt_tokens} prompt + {w.output_tokens} output tokens, "
          f"{args.threads} threads")
    ratios = []
    for r in range(args.rounds):
        order = ("transposed", "onednn") if r % 2 == 0 else ("onednn", "transposed")
        totals, tokens = {}, {}
        for kernel in order:
            os.environ["HYBRIDKV_DECODE_GEMM"] = kernel
            linear.decode_kernel.cache_clear()
            engine = ours_engine(model)
            run = run_ours(engine, w)
            totals[kernel], tokens[kernel] = run.total, run.tokens
        same = sum(a == b for a, b in zip(tokens["transposed"], tokens["onednn"]))
        ratios.append(totals["transposed"] / totals["onednn"])
        print(f"round {r}: transposed {totals['transposed']:.1f} s, oneDNN {totals['onednn']:.1f} s, "
              f"ratio {ratios[-1]:.2f}; sequences equal {same}/{len(w.prompts)}")
    print(f"transposed / oneDNN total time, median of {args.rounds}: {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
