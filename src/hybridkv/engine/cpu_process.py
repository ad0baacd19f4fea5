"""Process settings of a CPU engine, made once when an engine is built on a CPU: torch's threads
fitted to the cores the process may use, and freed memory kept for the next step's tensors."""

from __future__ import annotations

import ctypes
import os
import sys

import torch

__all__ = ["fit_threads_to_affinity", "keep_freed_memory"]


def fit_threads_to_affinity() -> int:
    """Lower torch's CPU threads to the cores this process may run on (``sched_getaffinity``),
    never raise them (a smaller setting is the user's); returns the count in force.

    torch counts the machine's cores; a process pinned to fewer (taskset, a container's
    cpuset) would otherwise run more threads than cores, and its matmuls wait at every barrier.
    """
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return torch.get_num_threads()
    if 0 < allowed < torch.get_num_threads():
        torch.set_num_threads(allowed)
    return torch.get_num_threads()


#: glibc's ``mallopt`` parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEPT: bool | None = None


def keep_freed_memory() -> bool:
    """On Linux with glibc, keep freed memory in the heap for the next tensor (once per process;
    ``HYBRIDKV_KEEP_FREED_MEMORY=0`` opts out); whether it is in force.

    glibc maps every block over its mmap threshold anew and returns it when freed, so each
    multi-megabyte tensor of a step (a prefill chunk's activations, a batch's gathered keys)
    pays its page faults again. With blocks up to 256 MiB served from the heap and up to 1 GiB
    of its free top kept (what vLLM's CPU guide gets by preloading tcmalloc), those tensors
    reuse pages already mapped: batched steps spend less time in page faults; a single
    stream's decode, whose tensors are small, is unaffected.
    """
    global _KEPT
    if _KEPT is None:
        _KEPT = False
        if sys.platform.startswith("linux") and os.environ.get("HYBRIDKV_KEEP_FREED_MEMORY", "1") != "0":
            try:
                mallopt = ctypes.CDLL(None).mallopt
                _KEPT = bool(mallopt(_M_MMAP_THRESHOLD, 256 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
            except (AttributeError, OSError):  # not glibc
                _KEPT = False
    return _KEPT

