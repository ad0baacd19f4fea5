"""``--plot``: KV usage and running requests over time, hybrid vs all-full (matplotlib, optional)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from hybridkv.errors import InvalidArgumentError
from hybridkv.scheduler.simulator import SimulationResult

__all__ = ["check_plot_path", "plot_results"]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError("--plot needs matplotlib: pip install 'hybridkv[plot]'") from None
    return plt


def check_plot_path(path: str | Path) -> Path:
    """``path`` if a plot can be written there (call it before the run): matplotlib is
    installed, the suffix is a format it writes, the folder exists and is writable."""
    plt = _pyplot()
    path = Path(path)
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        shown = f"suffix .{suffix}" if suffix else "no suffix"
        raise InvalidArgumentError(f"cannot plot to {path}: {shown}; use one of .{', .'.join(sorted(formats))}")
    folder = path.parent
    if not folder.is_dir():
        raise InvalidArgumentError(f"cannot write {path}: folder {folder} does not exist")
    if path.is_dir():
        raise InvalidArgumentError(f"cannot write {path}: it is a folder")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InvalidArgumentError(f"cannot write {path}: permission denied")
    return path


def plot_results(results: Sequence[SimulationResult], path: str | Path, title: str = "") -> Path:
    path = check_plot_path(path)
    plt = _pyplot()
    fig, (ax_usage, ax_running) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for res in results:
        steps = range(len(res.usage))
        ax_usage.plot(steps, [100 * u for u in res.usage], label=f"{res.name} ({res.steps} steps)", linewidth=1)
        ax_running.plot(steps, res.running, label=res.name, linewidth=1)
    ax_usage.set_ylabel("KV cache in use (%)")
    ax_usage.set_ylim(0, 105)
    ax_usage.legend(loc="upper right")
    ax_running.set_ylabel("running requests")
    ax_running.set_xlabel("scheduler step")
    ax_running.legend(loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path
