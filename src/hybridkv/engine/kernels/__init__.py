"""Triton kernels of the engine's GPU path: the KV write and paged attention.

Importing this package imports nothing heavy; :func:`triton_unavailable` says why the
kernels cannot run on a device (None when they can), and the kernel modules import
triton only when loaded. On a CPU the kernels run under triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is first imported), which is how CI tests
them against the reference attention.
"""

from __future__ import annotations

import os

from hybridkv.engine_config import ATTENTION_BACKENDS as BACKENDS, check_backend_name

__all__ = ["BACKENDS", "check_backend_name", "cpu_kernels_unavailable", "interpreter_on", "resolve_backend",
           "triton_unavailable"]


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


def resolve_backend(name: object, device_type: str, quantized: bool = False) -> str:
    """The backend a config's ``attention_backend`` names on ``device_type``.

    ``"auto"``: ``"triton"`` on CUDA when the kernels can run there; on a CPU ``"cpu"`` (the
    fused C decode kernels, :mod:`hybridkv.engine.attention_cpu`) for a ``quantized`` model
    when they build, else ``"reference"`` (the exact path stays the default). ``"triton"`` or
    ``"cpu"`` where they cannot run is an InvalidConfigError saying why.
    """
    from hybridkv.errors import InvalidConfigError

    check_backend_name(name)
    if name == "auto":
        if device_type == "cuda":
            return "triton" if triton_unavailable("cuda") is None else "reference"
        return "cpu" if device_type == "cpu" and quantized and cpu_kernels_unavailable() is None else "reference"
    if name == "triton":
        why = triton_unavailable(device_type)
        if why is not None:
            raise InvalidConfigError(f"attention_backend 'triton' cannot run here: {why}")
    if name == "cpu":
        why = "it runs on a CPU, not " + device_type if device_type != "cpu" else cpu_kernels_unavailable()
        if why is not None:
            raise InvalidConfigError(f"attention_backend 'cpu' cannot run here: {why}")
    return str(name)


def cpu_kernels_unavailable() -> str | None:
    """Why the fused CPU kernels cannot be built here (None when they can; builds them once)."""
    from hybridkv.engine import cpu_ops

    return cpu_ops.unavailable()
