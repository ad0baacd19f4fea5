"""Fused CPU kernels of the decode path, compiled from the C sources beside this file on first use.

A CPU decode step of a small model spends more time between its matmuls than in them: per
layer an RMSNorm is ~8 torch ops, and the paged attention of one query a K/V write, a key
gather, ``scaled_dot_product_attention`` and views (the measured costs: README, Results).
Kernels in plain C replace them (fp32):

* :func:`rms_norm` - rows of ``[T, H, D]`` (any row strides) normalized and scaled by a
  per-head multiplier ``[H or 1, D]`` (:meth:`~hybridkv.engine.models.norms.RMSNorm.scale`);
* :func:`rope_rotate_half` - RoPE of q and k heads in one pass (bit for bit the torch ops');
* :func:`gated_act` - the gated MLP's ``act(gate) * up`` (silu, gelu-tanh) in one pass;
* :func:`decode_attention` - one query per sequence: the step's K/V written to their slots,
  then scores, softmax and the weighted values read straight through the block table
  (no gather), GQA by ``h // rep``;
* :func:`q8_linear`, :func:`q4_linear` - fp32 rows times an int8 / int4 weight
  (:mod:`~hybridkv.engine.models.quantize`), split by output rows over a small pool of threads
  (``pool.c``; :func:`hold_cores` says when it may use more than one);
* ``decode_stack`` - all decoder layers of a decode step in one call, from a plan of pointers
  (:class:`~hybridkv.engine.models.fused_decode.FusedDecode`).

The sources are compiled once per machine, compiler and source (``gcc -O3 -march=native
-fopenmp-simd``, a few seconds) into ``<cache>/cpu_ops/`` (the tensor cache's folder,
:func:`~hybridkv.engine.models.tensor_cache.cache_dir`; a temporary folder when that is off)
and loaded as an extension module; each load marks its file used, and a build removes the
modules there no load has used for :data:`PRUNE_AFTER_DAYS` days (older sources, other
compilers) and build leftovers. Where it cannot be built (no compiler, no Python headers)
:func:`load` returns None, :func:`unavailable` says why, and the engine keeps its torch path;
``HYBRIDKV_CPU_OPS=off`` turns them off, ``HYBRIDKV_CPU_OPS=generic`` builds them without
intrinsics (what a CPU without AVX-512 runs). The kernels' results differ from torch's by
float rounding (another summation order, a polynomial ``exp``): the engine uses them only on
its fast paths (weight-only quantization), never on the exact fp32 default.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["decode_attention", "gated_act", "hold_cores", "load", "q4_linear", "q8_linear", "rms_norm",
           "rope_rotate_half", "unavailable"]

HERE = Path(__file__).parent
#: compiled together into one module (the header first: it is part of the build's key)
SOURCES = tuple(HERE / name for name in ("cpu_ops.h", "cpu_ops.c", "rowops.c", "attention.c", "qmatmul.c", "pool.c",
                                          "decode_stack.c", "qmatmul.h", "qmatmul_bf16.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC",
         "-std=gnu11", "-pthread")
MODULE = "_hybridkv_cpu_ops"

_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cpu_flags() -> str:
    """What ``-march=native`` compiles for: the CPU's feature flags (a home folder shared by
    machines of other CPUs must not share the module)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform

        return platform.machine() + platform.processor()


def _flags() -> tuple[str, ...]:
    """:data:`FLAGS`, and ``-DHYBRIDKV_GENERIC`` (plain loops, no intrinsics) when
    ``HYBRIDKV_CPU_OPS=generic``."""
    return FLAGS + (("-DHYBRIDKV_GENERIC",) if _mode() == "generic" else ())


def _mode() -> str:
    return os.environ.get("HYBRIDKV_CPU_OPS", "").strip().lower()


#: a build removes the compiled modules beside it that no load has used for this long
PRUNE_AFTER_DAYS = 30


def _prune(folder: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Remove the modules in ``folder`` other than ``keep`` unused for :data:`PRUNE_AFTER_DAYS`
    days, and build leftovers (``*.tmp-PID``) over a day old; what it removed. A process that
    still runs one keeps its mapping (Linux frees the file when it unmaps it); failures are
    ignored (another process pruning, a read-only folder)."""
    now = time.time() if now is None else now
    removed = []
    for p in folder.glob(f"{MODULE}-*"):
        try:
            age = now - p.stat().st_mtime
            stale = (".tmp-" in p.name and age > 86_400) or age > PRUNE_AFTER_DAYS * 86_400
            if p != keep and stale:
                p.unlink()
                removed.append(p)
        except OSError:
            pass
    return removed


def _build(folder: Path, cc: str) -> Path:
    """The compiled module's path under ``folder`` (built there when missing; marked used)."""
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = _flags()
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(flags).encode() + version.encode()
                         + include.encode() + _cpu_flags().encode())
    path = folder / f"{MODULE}-{key.hexdigest()[:16]}{suffix}"
    try:
        os.utime(path)  # used now: :func:`_prune` keeps it
        return path
    except FileNotFoundError:  # not built yet (or pruned a moment ago)
        pass
    except OSError:  # there, in a folder we may not write
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"  # unique on a shared folder too
    cmd = [cc, *flags, f"-I{include}", *(str(p) for p in SOURCES if p.suffix == ".c"), "-o", str(tmp), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cc} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    os.replace(tmp, path)  # another process may have built it meanwhile: same bytes
    _prune(folder, path)
    return path


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _load_uncached() -> ModuleType:
    if _mode() in ("off", "0", "false", "no"):
        raise RuntimeError("turned off (HYBRIDKV_CPU_OPS=off)")
    missing = [p.name for p in SOURCES if not p.exists()]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not installed beside {__name__}")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        raise RuntimeError("no Python headers (Python.h) to compile against")
    from hybridkv.engine.models.tensor_cache import cache_dir

    base = cache_dir()
    folder = base / "cpu_ops" if base is not None else Path(tempfile.mkdtemp(prefix="hybridkv-cpu-ops-"))
    for attempt in range(2):  # another process's build may prune an old module between our check and load
        try:
            path = _build(folder, cc)
        except OSError:  # a read-only cache folder: build in a temporary one
            path = _build(Path(tempfile.mkdtemp(prefix="hybridkv-cpu-ops-")), cc)
        try:
            module = _import(path)
            break
        except (ImportError, OSError):
            if attempt or path.exists():
                raise
    module.set_threads(1)  # the kernels' threads while torch holds the cores (hold_cores)
    return module


def load() -> ModuleType | None:
    """The compiled kernels, built on first call (None where they cannot be: :func:`unavailable`)."""
    if "module" not in _state:
        with _lock:
            if "module" not in _state:
                try:
                    _state["module"] = _load_uncached()
                except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as exc:
                    _state["module"], _state["why"] = None, str(exc)
                    off = "HYBRIDKV_CPU_OPS" in str(exc)
                    logging.getLogger(__name__).log(
                        logging.INFO if off else logging.WARNING, "fused CPU kernels unavailable (%s): torch ops instead", exc
                    )
    return _state["module"]  # type: ignore[return-value]


def hold_cores(kernels: bool) -> None:
    """Hand the process's cores to the kernels (``True``: the quantized matmuls split over them,
    torch's ops run on one thread) or to torch (``False``: torch's threads as they were, the
    kernels on one). Two thread pools spinning for one core stall each other for a scheduler
    slice (~1-4 ms: a 10 us op after a split matmul took 1 ms), so one of them holds the cores:
    the kernels in decode steps (small torch ops), torch in prefill (its GEMMs and attention).
    Sticky: a no-op when the cores are already where asked."""
    if kernels == _state.get("kernels", False) or load() is None:
        return
    if kernels:
        threads = torch.get_num_threads()
        _state["torch_threads"] = threads
        torch.set_num_threads(1)
        _state["module"].set_threads(threads)
    else:
        _state["module"].set_threads(1)
        torch.set_num_threads(_state.get("torch_threads", torch.get_num_threads()))
    _state["kernels"] = kernels


def unavailable() -> str | None:
    """Why the kernels cannot be used (None when :func:`load` gives them)."""
    load()
    return _state.get("why")  # type: ignore[return-value]


def _check(*tensors: torch.Tensor | None, dtype: torch.dtype) -> None:
    """The kernels read raw memory: refuse (ValueError) what they cannot read as ``dtype`` rows."""
    for x in tensors:
        if x is not None and (x.dtype is not dtype or not x.is_cpu or x.stride(-1) != 1):
            raise ValueError(f"cpu_ops: expected {dtype} CPU tensors with unit stride in the last dim, got "
                             f"{x.dtype} on {x.device} with strides {x.stride()}")


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., D] or [T, H, D] fp32 (unit stride in D) -> [same shape] fp32 contiguous:
    ``x / sqrt(mean(x^2) + eps) * scale``, scale [D] or [H, D] fp32 contiguous (per head)."""
    ops = load()
    _check(x, scale, dtype=torch.float32)
    d = x.shape[-1]
    if not scale.is_contiguous() or scale.shape[-1] != d:
        raise ValueError("rms_norm: scale must be [D] or [H, D] contiguous")
    if x.dim() == 3:
        t, h = x.shape[0], x.shape[1]
        st, sh = x.stride(0), x.stride(1)
    else:
        x = x.reshape(-1, d) if x.dim() != 2 else x
        t, h, st, sh = x.shape[0], 1, x.stride(0), 0
    rows = 1 if scale.dim() == 1 else scale.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32)
    elif out.shape != x.shape or out.dtype is not torch.float32 or not out.is_contiguous():
        raise ValueError("rms_norm: out must be fp32 contiguous in x's shape")
    ops.rms_norm(x.data_ptr(), out.data_ptr(), scale.data_ptr(), t, h, d, st, sh, rows, eps)
    return out


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] fp32 (unit stride in D), cos / sin [T, 1, D] fp32 (``RotaryEmbedding.cos_sin``,
    rows contiguous) -> [T, H, D] contiguous: :func:`~hybridkv.engine.models.rope.apply_rotate_half`,
    bit for bit (each product and the sum rounded alone)."""
    _check(x, cos, sin, dtype=torch.float32)
    t, h, d = x.shape
    if not (cos.shape == sin.shape == (t, 1, d) and cos.stride() == sin.stride() and cos.is_contiguous()):
        raise ValueError("rope_rotate_half: cos / sin must be [T, 1, D] contiguous")
    out = torch.empty((t, h, d), dtype=torch.float32)
    load().rope_rotate_half(x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, h, d, x.stride(0),
                            x.stride(1), cos.stride(0))
    return out


#: :func:`gated_act`'s activations (their kernel codes)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [T, 2I] fp32 (unit stride in the last dim) -> [T, I]: ``act(gate) * up``, ``act``
    one of :data:`ACTIVATIONS` (silu; gelu with the tanh approximation)."""
    _check(gate_up, dtype=torch.float32)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError("gated_act: gate_up must hold gate and up halves of one size")
    out = torch.empty((t, two_i // 2), dtype=torch.float32)
    load().gated_act(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, gate_up.stride(0), ACTIVATIONS[act])
    return out


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    kv: torch.Tensor,
    tables: torch.Tensor,
    first: torch.Tensor,
    pos: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence through its block table. q [S, Hq, D]; k_new / v_new [S, Hkv, D]
    (written at position ``pos[s]`` first; None: nothing written); kv [2 Hkv, num_slots, D]
    contiguous (keys, then values); tables [S, W] int64 (rows contiguous); first / pos [S]
    int64: sequence s attends to positions first[s] .. pos[s]. All fp32 with unit stride in D.
    Returns out [S, Hq, D] contiguous."""
    ops = load()
    s, hq, d = q.shape
    hkv = kv.shape[0] // 2
    f32, i64 = torch.float32, torch.int64
    if (q.dtype is not f32 or kv.dtype is not f32 or tables.dtype is not i64 or first.dtype is not i64
            or pos.dtype is not i64 or not (q.is_cpu and kv.is_cpu and tables.is_cpu and first.is_cpu and pos.is_cpu)
            or (k_new is not None and (k_new.dtype is not f32 or v_new.dtype is not f32 or not k_new.is_cpu
                                       or not v_new.is_cpu))):
        _check(q, k_new, v_new, kv, dtype=f32)  # raises, naming the tensor's dtype
        _check(tables, first, pos, dtype=i64)
    if (q.stride(2) != 1 or not kv.is_contiguous() or kv.dim() != 3 or kv.shape[2] != d or hkv < 1 or hq % hkv
            or tables.dim() != 2 or tables.shape[0] < s or tables.stride(1) != 1 or first.shape != (s,)
            or pos.shape != (s,) or not first.is_contiguous() or not pos.is_contiguous() or block_size < 1
            or (k_new is not None and (k_new.stride(2) != 1 or k_new.shape != (s, hkv, d) or k_new.shape != v_new.shape))
            or (out is not None and (out.shape != (s, hq, d) or out.dtype is not f32 or not out.is_contiguous()))):
        raise ValueError("decode_attention: q [S, Hq, D], k_new / v_new [S, Hkv, D] and kv [2 Hkv, slots, D] "
                         "contiguous (Hq a multiple of Hkv), tables [>= S, W] and first / pos [S] contiguous int64, "
                         "unit strides in D, block size >= 1, out [S, Hq, D] fp32 contiguous")
    out = torch.empty((s, hq, d), dtype=torch.float32) if out is None else out
    if k_new is None:
        kp = vp = 0
        ns = nh = 0
    else:
        if k_new.stride() != v_new.stride():
            v_new = v_new.contiguous()
            k_new = k_new.contiguous()
        kp, vp = k_new.data_ptr(), v_new.data_ptr()
        ns, nh = k_new.stride(0), k_new.stride(1)
    ops.decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1), kp, vp, ns, nh, kv.data_ptr(), kv.shape[1], hkv, d,
        hq // hkv, tables.data_ptr(), tables.stride(0), tables.shape[1], first.data_ptr(), pos.data_ptr(), s, block_size,
        scale, out.data_ptr(),
    )
    return out


def _linear_rows(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    """x [M, K] fp32 with unit stride in K (rows at any stride), else ValueError."""
    if x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{what}: x must be [M, {k}] fp32 on the CPU with unit stride in K, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    return x


def q8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """x [M, K] fp32 (unit stride in K) times the int8 weight ``q`` [N, K] (contiguous) with
    per-row ``scales`` [N] fp32 -> [M, N] fp32: ``y[m, n] = scales[n] * sum_k x[m, k] q[n, k]``,
    split over the kernels' threads; ``bf16``: x rounded to bf16 first (bf16 dot products)."""
    n, k = q.shape
    _linear_rows(x, k, "q8_linear")
    if q.dtype is not torch.int8 or not q.is_contiguous() or scales.dtype is not torch.float32 \
            or scales.shape != (n,) or not scales.is_contiguous() or not (q.is_cpu and scales.is_cpu):
        raise ValueError("q8_linear: q must be [N, K] int8 contiguous and scales [N] fp32 contiguous")
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    load().q8_linear(x.data_ptr(), x.stride(0), x.shape[0], k, q.data_ptr(), scales.data_ptr(), n,
                     out.data_ptr(), n, bool(bf16))
    return out


def q4_linear(x: torch.Tensor, nibbles: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] fp32 (unit stride in K) times the int4 weight (``nibbles`` [N, K/2] uint8: column
    2j's code in byte j's low nibble, 2j+1's in its high one; ``scales_zeros`` [N, K/G, 2] bf16 or
    fp32, contiguous) -> [M, N] fp32: weights ``(code - 8) * scale + zero`` per group of ``group``
    (a multiple of 32) columns, split over the kernels' threads. With bf16 scales the inputs and
    the weights are rounded to bf16 (bf16 dot products), with fp32 ones they stay fp32."""
    n, half = nibbles.shape
    k = 2 * half
    _linear_rows(x, k, "q4_linear")
    sz = scales_zeros
    if (nibbles.dtype is not torch.uint8 or not nibbles.is_contiguous() or not nibbles.is_cpu
            or group < 32 or group % 32 or k % group or sz.shape != (n, k // group, 2) or not sz.is_contiguous()
            or sz.dtype not in (torch.bfloat16, torch.float32) or not sz.is_cpu):
        raise ValueError("q4_linear: nibbles [N, K/2] uint8 and scales_zeros [N, K/G, 2] bf16 / fp32 contiguous, "
                         "K a multiple of the group, the group a multiple of 32")
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    load().q4_linear(x.data_ptr(), x.stride(0), x.shape[0], k, nibbles.data_ptr(), sz.data_ptr(),
                     sz.dtype is torch.bfloat16, group, n, out.data_ptr(), n)
    return out
