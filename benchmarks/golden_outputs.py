"""Golden outputs for a behaviour-preserving change: record them, change the code, check bit for bit.

    python benchmarks/golden_outputs.py record /tmp/golden            # before the change
    python benchmarks/golden_outputs.py check /tmp/golden             # after it: exit 1 on any difference
    TRITON_INTERPRET=1 python benchmarks/golden_outputs.py record /tmp/golden --backends triton

Every tiny model family the tests build (seeded, no downloads: ``tests/support``), a tiny
GGUF (llama.cpp's writer, mixed quant types) and, when installed, SmolLM2, each run through
:class:`~hybridkv.engine.engine.LLMEngine` on every attention backend asked (``reference``,
``cpu``; ``triton`` under the interpreter) and weight path (exact, ``int8``, ``int4``):
three prompts of mixed lengths, greedy, a small block size and token budget (chunked prefill,
batched decode, a prefix hit). Recorded per case: every request's tokens and the logits of
every step that sampled, or the error the case raised (so a refusal must stay the same
refusal). ``check`` compares with ``torch.equal``: one different bit is a failure.
Bitwise results hold on one machine and thread count, not across CPU kinds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ([5, 9, 17, 3, 44, 8, 21, 60, 2, 11, 7, 30, 12, 19, 25, 4, 33, 41, 6, 14, 50, 1, 10, 27, 36, 9, 3],
           [5, 9, 17, 3, 44, 8, 21, 60, 2, 11, 7, 30, 12, 19, 25, 4, 70, 72],
           [13, 2, 88])
NEW_TOKENS = 6


def _models(work: Path) -> dict[str, Path]:
    from tests.support.hf_tiny import CONFIGS, EXTRA_CONFIGS, build_tiny
    from tests.support.qwen3_next_tiny import CONFIGS as NEXT, build_qwen3_next

    out: dict[str, Path] = {}
    for name in [*CONFIGS, *EXTRA_CONFIGS]:
        out[name] = work / name
        hf = build_tiny(name, out[name])
        if name in ("llama", "gemma3"):
            from tests.support.gguf_tiny import write_like_llama_cpp

            out[name + "_gguf"] = write_like_llama_cpp(hf, name, work / f"{name}.gguf")
    for name in NEXT:
        out[name] = work / name
        build_qwen3_next(name, out[name])
    try:
        from hybridkv.checkpoint import as_model_source

        as_model_source("smollm2-135m")
        out["smollm2"] = Path("smollm2-135m")
    except Exception:
        pass
    return out


def _run(path: Path, backend: str, quantization: str | None) -> dict:
    from hybridkv.engine.engine import EngineConfig, LLMEngine
    from hybridkv.sampling_params import SamplingParams

    config = EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=16, max_num_seqs=4,
                          attention_backend=backend, quantization=quantization, max_model_len=128)
    engine = LLMEngine(str(path), config)
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    vocab = engine.model.vocab_size
    rids = [engine.add_request([t % vocab for t in p], sampling) for p in PROMPTS]
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    logits: dict[str, list[torch.Tensor]] = {r: [] for r in rids}
    while engine.has_unfinished_requests():
        outs = engine.step()
        for rid, row in engine.last_logits.items():
            logits[rid].append(row.detach().float().clone())
        for o in outs:
            tokens[o.request_id] = list(o.output_token_ids)
    return {"tokens": [tokens[r] for r in rids], "logits": [torch.stack(logits[r]) for r in rids]}


def _cases(models: dict[str, Path], backends: list[str]):
    for name, path in models.items():
        for backend in backends:
            quants = [None] if backend == "triton" else [None, "int8", "int4"]
            if name == "smollm2":  # the real model: its quantized paths (the C kernels at full size)
                quants = [] if backend != "cpu" else ["int8", "int4"]
            for q in quants:
                yield f"{name}/{backend}/{q or 'exact'}", path, backend, q


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=("record", "check"))
    p.add_argument("folder", type=Path)
    p.add_argument("--backends", default="reference,cpu")
    args = p.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    backends = args.backends.split(",")
    torch.set_num_threads(2)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        models = _models(Path(tmp))
        for case, path, backend, q in _cases(models, backends):
            file = args.folder / (case.replace("/", "__") + ".pt")
            try:
                result = _run(path, backend, q)
            except Exception as exc:  # a refusal is part of the behaviour
                result = {"error": f"{type(exc).__name__}: {exc}".replace(tmp, "<tmp>")}
            if args.action == "record":
                torch.save(result, file)
                print(f"recorded {case}: {result.get('error') or result['tokens']}", flush=True)
                continue
            want = torch.load(file)
            same = want.keys() == result.keys() and all(
                want[k] == result[k] if k != "logits" else
                all(torch.equal(a, b) for a, b in zip(want[k], result[k])) and len(want[k]) == len(result[k])
                for k in want
            )
            failed += not same
            print(f"{'same' if same else 'DIFFERENT'} {case}", flush=True)
            if not same:
                print(f"   want {want.get('error') or want['tokens']}\n   got  {result.get('error') or result['tokens']}")
    if args.action == "check":
        print(f"{failed} cases differ" if failed else "every case is the same, bit for bit")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
