"""``--plot``: KV usage and running requests over time, hybrid vs all-full (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hybridkv.errors import InvalidArgumentError
from hybridkv.scheduler.simulator import SimulationResult

__all__ = ["plot_results"]


def plot_results(results: Sequence[SimulationResult], path: str | Path, title: str = "") -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError("--plot needs matplotlib: pip install 'hybridkv[plot]'") from None
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise InvalidArgumentError(f"cannot write {path}: folder {path.parent} does not exist")
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
