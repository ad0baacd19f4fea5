"""Generation throughput: LLMEngine vs transformers ``generate``, 32 concurrent requests.

    python3 benchmarks/bench_engine.py [--quick] [--rounds N] [--threads N] [--workloads padded,equal]
                                       [--hf-attn both|sdpa|eager]

The model is a tiny random ``Llama4ForCausalLM`` built here (no downloads): fp32,
hidden 256, 8 layers (6 chunked-local RoPE layers with chunk 64, 2 NoPE full
layers), 8 query / 2 KV heads of 32, dense MLP 512, vocab 1024, weights re-drawn
large enough that greedy tokens are well separated. It is saved with
``save_pretrained`` to a temp dir and loaded from there by both sides.

Two workloads, timed in the same rounds and reported side by side: ``padded``, 32
random prompts of 64-256 tokens (HF left-pads them to the longest and computes the
padding too), and ``equal``, 32 random prompts of exactly 160 tokens (about the same
total; HF's batched generate does no padding work, so this ratio is the engine
against HF on equal terms). 48 new tokens each (``--quick``: 32 new tokens, 3 rounds,
about 50 s), greedy, no stop token.

* ours: a fresh ``LLMEngine`` per round, built before the clock starts (block 16,
  default budget 2048 tokens / step, prefix caching on; the prompts share nothing, and
  a hit would abort the run), then one ``engine.generate`` of all 32 prompts, batched
  by the scheduler (chunked prefill, then 32-wide decode), no EOS stop (``ignore_eos``,
  as HF's side). Its linears run on prepacked weight copies (the loader's default on
  CPU fp32: transposed for decode-sized inputs, oneDNN for prefill, see
  ``hybridkv.engine.layers.linear``); the full run also times ``ours-plain``, the
  same engine on ``F.linear`` (MKL, the GEMMs HF uses), to show what that part buys.
* HF: what a user batching with transformers runs: one ``model.generate`` call on
  the 32 prompts left-padded with an ``attention_mask`` (no padding when lengths are
  equal), its default dynamic cache, ``torch.inference_mode``; timed twice per round,
  with ``sdpa`` attention (``hf-sdpa``, what ``from_pretrained`` picks by default for
  Llama 4) and with ``eager`` (``hf-eager``). The headline ratio is against HF's
  default, ``hf-sdpa``.

All run in this process with the same ``torch.set_num_threads`` (printed), in an
order rotated round by round (workloads, and the sides within each) so machine drift
hits every side; tokens/s counts generated tokens; per round and workload the ratio
HF time / our time, and the median (and range) over rounds. The first round's tokens
of each workload are then checked against HF's batched output for all 32 requests and
against unpadded single-request HF ``generate`` for four of them (a mismatch aborts
before the summary). The machine this was written on is shared: expect +-15 %
between rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import _paths  # noqa: E402,F401  (this checkout's src and tests.support importable)

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.models import load_model  # noqa: E402
from hybridkv.scheduler import SamplingParams  # noqa: E402

NUM_REQUESTS = 32
VOCAB = 1024


def build_model(path: Path, seed: int = 0) -> None:
    """A random tiny Llama 4 text model saved (safetensors) under ``path``."""
    cfg = tf.Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        intermediate_size_mlp=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        attention_chunk_size=64,
        max_position_embeddings=1024,
        moe_layers=[],
    )
    torch.manual_seed(seed)
    model = tf.Llama4ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF's std-0.02 init gives near-uniform logits; make tokens well separated
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * noise)  # norm weights
            else:
                p.copy_(noise * (1.5 / p.shape[-1] ** 0.5))
    model.save_pretrained(path)


def load_hf(path: Path, attn: str = "eager"):
    model = tf.Llama4ForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # never stop early
    model.generation_config.pad_token_id = 0
    return model


def make_prompts(equal: bool, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [160] * NUM_REQUESTS if equal else torch.randint(64, 257, (NUM_REQUESTS,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """One batched ``generate``: left-padded prompts + attention_mask; new tokens per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, L], pad id 0 on the left
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, L]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    return out[:, width:].tolist()


def new_engine(model) -> LLMEngine:
    """A fresh engine (empty prefix cache) over the loaded model; built outside the timed region."""
    return LLMEngine(model, EngineConfig(block_size=16, max_model_len=512, max_num_seqs=64))


def ours_generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))  # as HF: no EOS stop
    if any(o.num_cached_tokens for o in outs):
        raise AssertionError("prefix cache hits between random prompts: the comparison would be unfair")
    return [list(o.output_token_ids) for o in outs]


def check_tokens(mine: dict[str, list[list[int]]], batched: list[list[int]], hf_model, prompts, new_tokens) -> None:
    """Ours (each variant) vs HF's batched generate for all requests, and vs unpadded HF for four."""
    for name, tokens in mine.items():
        same = sum(a == b for a, b in zip(tokens, batched))
        print(f"check: {name} == HF batched generate for {same}/{len(prompts)} requests")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    picks = sorted({order[0], order[len(order) // 3], order[2 * len(order) // 3], order[-1]})
    for i in picks:
        alone = hf_generate(hf_model, [prompts[i]], new_tokens)[0]
        ok = all(alone == m[i] for m in mine.values())
        print(f"check: request {i:2d} ({len(prompts[i])}-token prompt): ours vs HF unpadded single generate: "
              f"{'equal' if ok else 'DIFFERENT'}")
        if not ok:
            raise SystemExit("token mismatch against HF: the engine is wrong, the numbers above are meaningless")
    if any(m != batched for m in mine.values()):
        print("  (HF's padded batch differs from its own unpadded runs there; ours matches the unpadded runs)")


WORKLOADS = {"padded": "left-padded (64-256 tokens)", "equal": "equal lengths (160 tokens, no padding)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~50 s: 32 new tokens, 3 rounds, no plain-linear variant")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both sides (default 1)")
    ap.add_argument("--workloads", default="padded,equal",
                    help="comma list of padded (random 64-256-token prompts) and equal (all 160); default both")
    ap.add_argument("--hf-attn", default="both", choices=["both", "sdpa", "eager"],
                    help="HF attention(s) to time (default both; sdpa is HF's default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 5)
    new_tokens = 32 if args.quick else 48
    names_w = [w for w in args.workloads.split(",") if w in WORKLOADS]
    if not names_w:
        raise SystemExit(f"--workloads: choose from {', '.join(WORKLOADS)}")
    workloads = {w: make_prompts(w == "equal") for w in names_w}

    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp))
        attns = ["sdpa", "eager"] if args.hf_attn == "both" else [args.hf_attn]
        hf_models = {f"hf-{a}": load_hf(Path(tmp), a) for a in attns}
        hf_model = next(iter(hf_models.values()))  # the reference (HF's default when timed)
        models = {"ours": load_model(tmp)}
        if not args.quick:  # the same engine on F.linear (MKL, as HF): what the prepacked copies buy
            models["ours-plain"] = load_model(tmp, prepack=False)
    print(f"tiny Llama-4 (hidden 256, 8 layers, chunk 64, vocab {VOCAB}, fp32, CPU), "
          f"torch threads {torch.get_num_threads()} (both sides), torch {torch.__version__}, transformers {tf.__version__}")
    for w, prompts in workloads.items():
        lens = [len(p) for p in prompts]
        print(f"{w}: {NUM_REQUESTS} requests, prompts {min(lens)}-{max(lens)} tokens (total {sum(lens)}), "
              f"{new_tokens} new tokens each, greedy; HF: one batched generate, "
              f"{'no padding' if len(set(lens)) == 1 else 'left-padded'}, attention {' and '.join(attns)}")
    warm = next(iter(workloads.values()))[:2]
    for model in models.values():  # first-call costs (oneDNN primitives, allocator) out of the rounds
        ours_generate(new_engine(model), warm, 2)
    for m in hf_models.values():
        hf_generate(m, warm, 2)

    ref = next(iter(hf_models))  # the headline baseline
    names = [*models, *hf_models]
    times = {w: {k: [] for k in names} for w in workloads}
    outputs: dict[str, dict[str, list[list[int]]]] = {w: {} for w in workloads}
    generated = NUM_REQUESTS * new_tokens
    for r in range(rounds):
        order_w = names_w[r % len(names_w):] + names_w[: r % len(names_w)]
        for w in order_w:
            prompts = workloads[w]
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
                engine = new_engine(models[name]) if name in models else None
                t0 = time.perf_counter()
                if engine is not None:
                    out = ours_generate(engine, prompts, new_tokens)
                else:
                    out = hf_generate(hf_models[name], prompts, new_tokens)
                times[w][name].append(time.perf_counter() - t0)
                outputs[w].setdefault(name, out)
        line = "   ".join(f"{w}: " + " ".join(f"ours/{h} {times[w][h][-1] / times[w]['ours'][-1]:.2f}x"
                                              for h in hf_models) for w in names_w)
        tps = "   ".join(f"{w} {generated / times[w]['ours'][-1]:.0f} tok/s" for w in names_w)
        print(f"round {r}: ours {tps}   {line}", flush=True)
    for w in names_w:
        print(f"[{w}]")
        check_tokens({k: outputs[w][k] for k in models}, outputs[w][ref], hf_model, workloads[w], new_tokens)
    print(f"\n{'workload':<8} {'':<11} {'median s':>9} {'tok/s':>7}" + "".join(f" {'vs ' + h:>24}" for h in hf_models))
    for w in names_w:
        for k in names:
            cells = ""
            for h in hf_models:
                ratios = [a / b for a, b in zip(times[w][h], times[w][k])]
                cells += f" {statistics.median(ratios):>8.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"
            med = statistics.median(times[w][k])
            print(f"{w:<8} {k:<11} {med:>9.3f} {generated / med:>7.0f}{cells}")
    print()
    for h in hf_models:
        cells = []
        for w in names_w:
            ratios = [a / o for a, o in zip(times[w][h], times[w]["ours"])]
            cells.append(f"{WORKLOADS[w]} {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)")
        print(f"ratio ours / {h} (tokens/s), median of {rounds} rounds: " + ";  ".join(cells)
              + ("   <- HF's default attention" if h == "hf-sdpa" else ""))


if __name__ == "__main__":
    main()
