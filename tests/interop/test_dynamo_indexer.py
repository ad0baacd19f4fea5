"""NVIDIA Dynamo's standalone KV indexer (``ai-dynamo-runtime``) subscribed to two replicas.

It decodes vLLM's events with integer block hashes (``serve``'s default form), scores a
prompt by its own hashes of the tokens the events carry, and replays what it missed from the
replicas' replay sockets. The oracle: each replica's ``/kv_cache/peek`` (the hit a request
would get now). On a full-attention model the indexer's score of every prompt, for every
replica, equals that hit (capped, as the engine caps a hit, below the prompt's last token),
and a repeat's ``cached_tokens`` equals it too.

The indexer binds every interface with no option to bind one, so the scenario
(:mod:`tests.interop.dynamo_scenario`) runs in a network namespace of its own (``unshare
-rn``); where user namespaces are unavailable the test is skipped and says why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.live

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16


def _isolated() -> str | None:
    """Why the scenario cannot run isolated (None: it can)."""
    if importlib.util.find_spec("dynamo") is None:
        return "ai-dynamo-runtime is not installed (pip install 'hybridkv[interop]')"
    try:
        ok = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no unshare: {exc}"
    if ok.returncode != 0:
        return f"no network namespace for the indexer (it binds 0.0.0.0): {ok.stderr.decode()[:200]}"
    return None


@pytest.mark.skipif(_isolated() is not None, reason=str(_isolated()))
def test_dynamo_scores_equal_each_replicas_hit_and_replay_fills_a_late_start():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(["unshare", "-rn", sys.executable, str(ROOT / "tests/interop/dynamo_scenario.py")],
                         capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["exit_codes"] == [0, 0] and out["indexer_errors"] == []
    assert out["early_cached"][1] > 0 and out["replayed"]
    assert out["queries"][0]["scores"][0] > 0  # the early prompt, learnt from the replay alone
    for q in out["queries"]:
        cap = (q["prompt_tokens"] - 1) // BLOCK * BLOCK  # the engine never hits a prompt's last token
        assert [min(s, cap) for s in q["scores"]] == q["peeks"], q
    last = out["queries"][-8:]  # every prompt after the whole workload
    assert [q["peeks"][k % 2] for k, q in enumerate(last)] == out["repeat_cached"]
    assert sum(out["repeat_cached"]) > 0
