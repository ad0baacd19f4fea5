"""Calls run at once in Python threads (the C kernels release the GIL): which ever disagree."""

from __future__ import annotations

import threading
from typing import Callable

import torch


def disagreeing_calls(calls: list[Callable[[], torch.Tensor]], wants: list[torch.Tensor], rounds: int,
                      timeout: float = 120.0) -> list[int]:
    """Run each of ``calls`` ``rounds`` times, each in its own thread, all at once; the indexes of
    the calls whose result ever differed from their ``wants`` (AssertionError if a thread is still
    running after ``timeout`` seconds)."""
    errors: list[int] = []

    def work(i: int) -> None:
        for _ in range(rounds):
            if not torch.equal(calls[i](), wants[i]):
                errors.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors
