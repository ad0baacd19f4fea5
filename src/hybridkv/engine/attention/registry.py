"""The attention backends by name, and the ``auto`` rule: the one place that knows backend names.

A backend is a class implementing :class:`~hybridkv.engine.attention.backend.AttentionBackend`;
this table maps its name to where the class lives (``"module:Class"``), imported only when the
backend is used, so listing names (the CLI's ``--attention-backend`` choices, a config's check)
imports no torch. A new backend is one module plus one line here, or, from outside the package,
one :func:`register_backend` call:

    register_backend("mine", "my_package.attention:MyBackend")
    LLMEngine(path, EngineConfig(attention_backend="mine"))

``auto`` is not a backend but a rule (:func:`resolve_backend`): the triton kernels on CUDA when
they run there; on a CPU the ``cpu`` backend (fused C decode kernels) for a quantized model when
the kernels build, else ``reference`` (the exact fp32 default keeps torch's ops).
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridkv.errors import InvalidConfigError

__all__ = ["AUTO", "backend_names", "check_backend_name", "get_backend", "register_backend", "resolve_backend",
           "unregister_backend"]

AUTO = "auto"

#: name -> "module:Class" (imported on first use)
_BACKENDS: dict[str, str] = {
    "reference": "hybridkv.engine.attention.reference:ReferenceBackend",
    "triton": "hybridkv.engine.attention.triton:TritonBackend",
    "cpu": "hybridkv.engine.attention.cpu:CpuBackend",
}
_instances: dict[str, Any] = {}  # name -> its AttentionBackend instance


def backend_names() -> tuple[str, ...]:
    """Every name a config may give: ``auto`` first, then the registered backends."""
    return (AUTO, *_BACKENDS)


def register_backend(name: str, target: str | type) -> None:
    """Make ``name`` a backend: ``target`` is its class or ``"module:Class"``. A name given again
    replaces the earlier entry (an override, as vLLM's ``register_backend``); ``auto`` cannot be."""
    if not isinstance(name, str) or not name or name == AUTO:
        raise InvalidConfigError(f"a backend name must be a non-empty string other than {AUTO!r}; got {name!r}")
    if not isinstance(target, (str, type)):
        raise InvalidConfigError(f"backend {name!r}: give its class or 'module:Class', got {target!r}")
    _BACKENDS[name] = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
    _instances.pop(name, None)


def unregister_backend(name: str) -> None:
    """Remove a backend :func:`register_backend` added (tests; a missing name is no error)."""
    _BACKENDS.pop(name, None)
    _instances.pop(name, None)


def check_backend_name(name: object) -> None:
    """Refuse (InvalidConfigError) a name that is neither ``auto`` nor a registered backend."""
    if name not in backend_names():
        raise InvalidConfigError(f"attention_backend must be one of {', '.join(backend_names())}; got {name!r}")


def get_backend(name: str) -> Any:
    """The :class:`~hybridkv.engine.attention.backend.AttentionBackend` registered as ``name`` (one instance per name; ``auto`` is resolved first:
    :func:`resolve_backend`). It does not check that the backend can run here."""
    if name not in _instances:
        if name == AUTO or name not in _BACKENDS:
            raise InvalidConfigError(f"no attention backend named {name!r}; registered: {', '.join(_BACKENDS)}")
        module, _, cls = _BACKENDS[name].partition(":")
        _instances[name] = getattr(importlib.import_module(module), cls)()
    return _instances[name]


def resolve_backend(name: object, device_type: str, quantized: bool = False) -> str:
    """The backend a config's ``attention_backend`` names on ``device_type`` ("cpu", "cuda").

    ``auto``: ``triton`` on CUDA when it can run there, else ``reference``; on a CPU ``cpu`` for a
    ``quantized`` model when its kernels build, else ``reference``. A named backend that cannot
    run here is an InvalidConfigError saying why (its :meth:`~AttentionBackend.unavailable`).
    """
    check_backend_name(name)
    if name == AUTO:
        preferred = ("triton" if device_type == "cuda" else "cpu" if device_type == "cpu" and quantized
                     else "reference")
        return preferred if get_backend(preferred).unavailable(device_type) is None else "reference"
    why = get_backend(str(name)).unavailable(device_type)
    if why is not None:
        raise InvalidConfigError(f"attention_backend {name!r} cannot run here: {why}")
    return str(name)
