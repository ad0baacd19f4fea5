"""Compile-on-first-use of the fused CPU kernels: the C sources beside this file built into one
extension module, cached on disk, loaded once per process.

The contract:

* **When it builds.** The first :func:`load` of a process looks for a module built from these
  exact inputs - the sources' bytes (:data:`SOURCES`), the flags (:data:`FLAGS`, plus
  ``-DHYBRIDKV_GENERIC`` in generic mode), the compiler's ``--version``, the Python headers'
  folder and the CPU's feature flags (what ``-march=native`` compiles for) - and compiles it
  only when there is none. The sha256 of those inputs names the file, so another source,
  compiler, Python or CPU gets its own module and a folder shared by several machines or
  environments never loads a foreign one. A build writes a temporary file and renames it into
  place: a concurrent loader sees a complete module or none, and two processes building at
  once write the same bytes. Later calls of :func:`load` return the module already loaded.
* **Where the cache lives.** ``<cache>/cpu_ops/<MODULE>-<first 16 hex digits of the key><EXT_SUFFIX>``,
  ``<cache>`` being the weight cache folder (``$HYBRIDKV_CACHE_DIR``, else ``~/.cache/hybridkv``);
  a fresh temporary folder when that cache is turned off or cannot be written.
* **How it prunes.** Each load marks its module used (its mtime set to now). A build then
  removes, in its folder, the modules of this name that no load has used for
  :data:`PRUNE_AFTER_DAYS` days (older sources, other compilers) and build leftovers
  (``*.tmp-*``) over a day old, never the module it just built; it ignores what it cannot
  remove. A module pruned between the look-up and the import is built again, once.
* **``HYBRIDKV_CPU_OPS``.** ``off`` (or ``0``, ``false``, ``no``): nothing is built or loaded.
  ``generic``: the kernels are built without intrinsics (plain loops), under their own key.
  The target is the CPU's ISA level (:mod:`~hybridkv.engine.cpu_ops.isa`: AVX-512, AVX2 + FMA
  or plain; ``HYBRIDKV_CPU_ISA`` lowers it), each level its own module. Unset or anything else: built for the CPU it runs on.
  ``CC`` names the compiler (else ``gcc``, else ``cc`` on ``PATH``).
* **Where it cannot be built** (turned off, no compiler, no Python headers, a failed
  compile): :func:`load` returns None, :func:`unavailable` says why, the reason is logged
  once (INFO when turned off, WARNING otherwise) and callers keep their torch path.

The loaded module starts with its thread pool at one thread (``set_threads(1)``). ``_state``
is the process's record of the kernels: the module (``"module"``), why it is missing
(``"why"``) and, written by :func:`~hybridkv.engine.cpu_ops.hold_cores`, who holds the cores
(``"kernels"``, ``"torch_threads"``).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

from hybridkv.engine.cpu_ops.isa import cpu_flags_line, cpu_isa

__all__ = ["FLAGS", "HERE", "MODULE", "PRUNE_AFTER_DAYS", "SOURCES", "load", "unavailable"]

HERE = Path(__file__).parent
#: compiled together into one module (the header first: it is part of the build's key)
SOURCES = tuple(HERE / name for name in ("cpu_ops.h", "cpu_ops.c", "rowops.c", "attention.c", "qmatmul.c", "pool.c",
                                          "decode_stack.c", "qmatmul.h", "qmatmul_bf16.c",
                                          "qmatmul_avx2.c", "gguf_blocks.h", "gguf_blocks.c",
                                          "gguf_blocks_vec.c"))
#: ``-fno-trapping-math``: no kernel reads the FP exception flags, and without it gcc keeps the
#: selects around a division (the activations' sigmoid, the softmax's exp) as branches and
#: vectorizes none of those loops (~10x slower per element)
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
         "-shared", "-fPIC", "-std=gnu11", "-pthread")
MODULE = "_hybridkv_cpu_ops"

_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cpu_flags() -> str:
    """What ``-march=native`` compiles for: the CPU's feature flags (a home folder shared by
    machines of other CPUs must not share the module)."""
    line = cpu_flags_line()
    if line is None:
        import platform

        return platform.machine() + platform.processor()
    return line


def _flags() -> tuple[str, ...]:
    """:data:`FLAGS` for this CPU's ISA level (:func:`~hybridkv.engine.cpu_ops.isa.cpu_isa`): its
    ``-march`` (``x86-64-v3`` for ``avx2``, tuned for the machine), and ``-DHYBRIDKV_GENERIC``
    (plain loops, no intrinsics) at level ``plain`` or when ``HYBRIDKV_CPU_OPS=generic``."""
    isa = cpu_isa()
    flags = tuple(f for f in FLAGS if not f.startswith("-march=")) + (f"-march={isa.march}",)
    if isa.march != "native":
        flags += ("-mtune=native",)
    if _mode() == "generic" or not isa.intrinsics:
        flags += ("-DHYBRIDKV_GENERIC",)
    return flags


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
    _compile(cc, flags, include, tmp)
    os.replace(tmp, path)  # another process may have built it meanwhile: same bytes
    _prune(folder, path)
    return path


def _compile(cc: str, flags: tuple[str, ...], include: str, out: Path) -> None:
    """Compile :data:`SOURCES` into the module ``out``: each C file to an object on its own core
    (as many at once as the process may use), then one link; RuntimeError naming the compiler's
    last line when a step fails. Says on stderr that it builds (a one-time wait of seconds)."""
    sources = [p for p in SOURCES if p.suffix == ".c"]
    print(f"hybridkv: building the CPU kernels once for this machine ({len(sources)} C files, {cc})",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="hybridkv-cc-") as objdir:
        objects = [Path(objdir) / f"{p.stem}.o" for p in sources]
        compile_flags = [f for f in flags if f != "-shared"]
        jobs = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
        pending = sorted(zip(sources, objects), key=lambda so: -so[0].stat().st_size)  # the longest first

        def one(so: tuple[Path, Path]) -> subprocess.CompletedProcess:
            return subprocess.run([cc, *compile_flags, f"-I{include}", "-c", str(so[0]), "-o", str(so[1])],
                                  capture_output=True, text=True, timeout=300)

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(one, pending))
        failed = next((r.stderr or r.stdout for r in results if r.returncode != 0), None)
        if failed is None:
            done = subprocess.run([cc, *flags, *(str(o) for o in objects), "-o", str(out), "-lm"],
                                  capture_output=True, text=True, timeout=300)
            failed = None if done.returncode == 0 else (done.stderr or done.stdout)
    if failed is not None:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"{cc} failed: {failed.strip().splitlines()[-1:]}")


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
        raise RuntimeError(f"{', '.join(missing)} not installed beside {__package__}")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        raise RuntimeError("no Python headers (Python.h) to compile against")
    from hybridkv.engine.loading.weight_cache import cache_dir

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
                    logging.getLogger(__package__).log(  # the package's logger, as before the split
                        logging.INFO if off else logging.WARNING, "fused CPU kernels unavailable (%s): torch ops instead", exc
                    )
    return _state["module"]  # type: ignore[return-value]


def unavailable() -> str | None:
    """Why the kernels cannot be used (None when :func:`load` gives them)."""
    load()
    return _state.get("why")  # type: ignore[return-value]
