"""Triton kernels of the engine's GPU path: the KV write and paged attention.

Importing this package imports nothing heavy; :func:`triton_unavailable` says why the
kernels cannot run on a device (None when they can), and the kernel modules import
triton only when loaded. On a CPU the kernels run under triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is first imported), which is how CI tests
them against the reference attention.
"""

from __future__ import annotations

import os

__all__ = ["interpreter_on", "triton_unavailable"]


def interpreter_on() -> bool:
    """True when triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable(device_type: str) -> str | None:
    """Why the triton kernels cannot run on ``device_type`` ("cuda", "cpu"), or None if they can."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken install
        return f"triton does not import ({type(exc).__name__}: {exc}); install the [gpu] extra"
    if device_type == "cuda":
        return None
    if device_type == "cpu" and interpreter_on():
        return None
    return (
        f"triton kernels need a CUDA device (got {device_type!r}); on a CPU only triton's interpreter "
        "runs them (TRITON_INTERPRET=1, for tests)"
    )
