"""The engines people already run, in front of real ``hybridkv serve`` replicas (extra ``[interop]``).

Every process binds 127.0.0.1 (Dynamo's indexer, which binds every interface, runs only in a
network namespace of its own: :mod:`tests.interop.test_dynamo_indexer`) and is bounded in
time (:class:`tests.support.processes.HybridkvProcess`, :class:`Process`). The replicas are
SmolLM2 (full attention: what these engines index) with KV events and replay on.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.support.processes import HybridkvProcess, wait_until  # noqa: E402

pytestmark = pytest.mark.live

MODEL = "smollm2-135m"
#: every replica: SmolLM2, a small context, events and their replay on ephemeral ports
REPLICA_ARGS = [MODEL, "--port", "0", "--max-model-len", "1024", "--num-blocks", "256",
                "--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://127.0.0.1:0"]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def shared_prefix_workload(n: int = 10) -> list[str]:
    """Prompts sharing two system prompts (64+ tokens each), with varying tails: repeats hit."""
    systems = ["You are a careful assistant who answers in one short sentence. " * 5,
               "Translate the user's words into plain English and nothing else. " * 5]
    questions = ["What is two plus two?", "Name a colour.", "Why is the sky blue?", "Say hello."]
    return [systems[i % 2] + questions[(i // 2) % len(questions)] + " " * (i // 8) for i in range(n)]


class Process:
    """Any command as a bounded process; its output (ANSI stripped) collected in ``lines``."""

    def __init__(self, argv: list[str], env: dict | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, **(env or {})))
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(_ANSI.sub("", line))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def wait_http(url: str, proc: Process | None = None, timeout: float = 60.0) -> None:
    """Until ``url`` answers below 500 (a process that exits first: the test fails)."""
    def up() -> bool:
        if proc is not None and proc.proc.poll() is not None:
            return True
        try:
            return httpx.get(url, timeout=2).status_code < 500
        except httpx.HTTPError:
            return False

    assert wait_until(up, timeout, 0.2), f"{url} not up in {timeout:.0f} s"
    assert proc is None or proc.proc.poll() is None, f"exited: {proc.output[-2000:]}"


def cached_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def replicas():
    """Two SmolLM2 replicas with KV events (module-scoped; stopped, every block free, at teardown)."""
    started = [HybridkvProcess(REPLICA_ARGS, threads=1) for _ in range(2)]
    yield started
    for r in started:
        assert r.stop() == 0, r.stderr[-2000:]


def requests_finished(base_url: str) -> float:
    """The replica's finished requests so far (its ``/metrics``)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def settle(seconds: float = 0.4) -> None:
    """Let a replica's KV events reach the subscribers (published once per engine step)."""
    time.sleep(seconds)
