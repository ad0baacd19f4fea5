"""Python ints to tensors, fast: the per-step host work of the runner and the planner.

``torch.tensor(list_of_ints)`` inspects every item; packing the ints into an
``array('q')`` and wrapping its buffer does not, and is far cheaper per int.
A prefill step's ids, or the block tables of a batch of requests in several groups,
are thousands of ints, so this is most of a decode step's host-side time.
"""

from __future__ import annotations

from array import array
from typing import Iterable

import torch

__all__ = ["long_tensor", "PinnedStager"]


def long_tensor(values: Iterable[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 tensor [n] of ``values`` (ints that fit in int64; OverflowError otherwise)."""
    buf = array("q", values)
    if not buf:
        return torch.empty(0, dtype=torch.long, device=device)
    out = torch.frombuffer(buf, dtype=torch.long)  # shares buf's memory and keeps it alive
    return out if torch.device(device).type == "cpu" else out.to(device)


class PinnedStager:
    """Python ints to a CUDA device without a host synchronisation.

    ``long_tensor`` on a CUDA device copies from pageable memory, which waits for the
    device; this packs each upload into the next free region of one pinned buffer and
    copies it asynchronously. Regions are never reused within a step: call :meth:`reset`
    at the start of a step, once the last one's results were read (that read waited for
    its copies). A buffer that overflows is replaced by a twice larger one; the old one
    stays alive until the next reset, as a copy from it may still be in flight.
    """

    def __init__(self, device: torch.device | str, capacity: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"  # elsewhere (tests) the same bookkeeping, unpinned
        self._buf = torch.empty(capacity, dtype=torch.long, pin_memory=self._pin)
        self._used = 0
        self._retired: list[torch.Tensor] = []

    def reset(self) -> None:
        self._used = 0
        self._retired.clear()

    def long_tensor(self, values: Iterable[int]) -> torch.Tensor:
        """int64 tensor [n] of ``values`` on the device (as :func:`long_tensor`)."""
        buf = array("q", values)
        n = len(buf)
        if not n:
            return torch.empty(0, dtype=torch.long, device=self.device)
        if self._used + n > self._buf.numel():
            self._retired.append(self._buf)
            self._buf = torch.empty(max(2 * self._buf.numel(), n), dtype=torch.long, pin_memory=self._pin)
            self._used = 0
        region = self._buf[self._used : self._used + n]
        region.copy_(torch.frombuffer(buf, dtype=torch.long))
        self._used += n
        if not self._pin:
            return region.clone()  # a CPU "device": the region itself would be overwritten after a reset
        return region.to(self.device, non_blocking=True)
