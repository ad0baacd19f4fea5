"""``hybridkv serve`` / ``hybridkv route`` as real processes on 127.0.0.1, for the live tests and
the benchmarks that drive them (``bench_route.py``, ``bench_serve.py``): one harness, one port helper.

Every process is bounded in time: one that does not print its ``listening on`` line within
``READY_TIMEOUT`` seconds, or does not exit within ``STOP_TIMEOUT`` of SIGTERM, is killed and
the caller gets an error (a failed test, or a benchmark's one-line exit).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["HybridkvProcess", "READY_TIMEOUT", "STOP_TIMEOUT", "free_port", "wait_until"]

READY_TIMEOUT = 90.0
STOP_TIMEOUT = 60.0
SRC = Path(__file__).resolve().parents[2] / "src"


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, never one this process handed out before (for endpoints that
    must be known before a process binds them: the OS may offer a just-closed port again, and a
    cluster asks for nine at once)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no fresh free port in 100 tries")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class HybridkvProcess:
    """``python -m hybridkv COMMAND ARGS`` in a subprocess; ``base_url`` once it is ready.

    ``threads``: its ``OMP_NUM_THREADS``; ``error``: what a failure to start or stop raises
    (AssertionError in tests, SystemExit in benchmarks). stderr is drained by a thread (kept in
    ``lines``), so the process never blocks on it.
    """

    def __init__(self, args: list[str], env: dict | None = None, command: str = "serve", wait: bool = True,
                 threads: int = 1, error: type[BaseException] = AssertionError,
                 ready_timeout: float = READY_TIMEOUT, stop_timeout: float = STOP_TIMEOUT) -> None:
        full_env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p))
        full_env.update(env or {})
        self.error, self.ready_timeout, self.stop_timeout = error, ready_timeout, stop_timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybridkv", command, *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.base_url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        if not self._ready.wait(self.ready_timeout) or not self.base_url:
            self.kill()
            raise self.error(f"not ready in {self.ready_timeout:.0f} s: {self.stderr[-3000:]}")

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on " in line and not self.base_url:
                self.base_url = line.split("listening on ", 1)[1].split()[0]
                self._ready.set()
        self._ready.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def stop(self, sig=signal.SIGTERM, timeout: float | None = None) -> int:
        """Signal the process and wait for it; its exit code (killed, then ``error``, past ``timeout``,
        by default ``stop_timeout``)."""
        timeout = self.stop_timeout if timeout is None else timeout
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self.error(f"did not exit {timeout:.0f} s after {sig!r}: {self.stderr[-2000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
