"""Per-client limits on the server (issue 39), in-process on the tiny model: 429 with
Retry-After past a client's limit (400 for a request no client could run), identities
from a client id header or from which of several API keys, and random admit / release
sequences keep :class:`~hybridkv.server.clients.Clients`' counts exact. The timed cases
(a stream beside requests holding every slot, a barrage of refused bodies) are live:
``test_noisy_neighbour.py``."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.errors import InvalidArgumentError, InvalidConfigError, RateLimitError
from hybridkv.server import ServerConfig
from hybridkv.server.clients import ANONYMOUS, Clients

from tests.support.tiers import examples
from tests.support.tiny_server import run_app

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def _config(**kw) -> ServerConfig:
    return ServerConfig(model_name="tiny", **kw)


def _rate_limited(r, limit: str) -> dict:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["type"] == limit and err["code"] == "rate_limit_exceeded", err
    return err


def test_per_client_limits_answer_429_and_count_clients_apart(tiny_llm):
    config = _config(client_id_header="X-Client-Id", max_seqs_per_client=4, max_tokens_per_client=100)
    alice, bob = {"x-client-id": "alice"}, {"x-client-id": "bob"}
    held = {"model": "tiny", "prompt": ["aa", "bb", "cc"], "max_tokens": 200, "ignore_eos": True}

    async def body(client, front, app):
        clients = app.state.serving.clients
        task = asyncio.create_task(client.post(CMPL, json=held, headers=alice))
        while clients.held("id:alice") == (0, 0):
            await asyncio.sleep(0.005)
        assert clients.held("id:alice")[0] == 3
        two = await client.post(CMPL, json={"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2}, headers=alice)
        chat_n = await client.post(CHAT, json={"model": "tiny", "n": 2, "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hi"}]}, headers=alice)
        one = await client.post(CMPL, json={"model": "tiny", "prompt": "a", "max_tokens": 2}, headers=alice)
        other = await client.post(CMPL, json={"model": "tiny", "prompt": ["a", "b", "c", "d"], "max_tokens": 2},
                                  headers=bob)
        five = await client.post(CMPL, json={"model": "tiny", "prompt": ["a"] * 5, "max_tokens": 2}, headers=bob)
        n5 = await client.post(CMPL, json={"model": "tiny", "prompt": "a", "n": 5, "max_tokens": 2}, headers=bob)
        tokens = await client.post(CMPL, json={"model": "tiny", "prompt": "x" * 101, "max_tokens": 2}, headers=bob)
        many_tokens = await client.post(CMPL, json={"model": "tiny", "prompt": "y" * 95, "max_tokens": 2}, headers=alice)
        anon = [await client.post(CMPL, json={"model": "tiny", "prompt": "z", "max_tokens": 1}) for _ in range(2)]
        assert (await task).status_code == 200
        return two, chat_n, one, other, five, n5, tokens, many_tokens, anon, dict(clients.seqs), dict(clients.tokens)

    (two, chat_n, one, other, five, n5, tokens, many_tokens, anon, seqs, toks), (free, usable) = run_app(tiny_llm, body,
                                                                                            config=config)
    assert free == usable
    assert "3 sequences unfinished" in _rate_limited(two, "requests")["message"]
    _rate_limited(chat_n, "requests")
    assert "prompt tokens unfinished" in _rate_limited(many_tokens, "tokens")["message"]
    assert one.status_code == 200 and other.status_code == 200, (one.text, other.text)
    for r, param in ((five, "prompt"), (n5, "n"), (tokens, "prompt")):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert [r.status_code for r in anon] == [200, 200]
    assert seqs == {} and toks == {}  # every response ended: nothing held


def test_identities_from_keys_and_headers():
    two_keys = Clients(_config(api_key=("k0", "k1"), max_seqs_per_client=2))
    assert two_keys.identify({"authorization": "Bearer k1"}) == "key:1"
    assert two_keys.identify({"authorization": "Bearer nope"}) is None
    assert two_keys.identify({}) is None
    assert Clients(_config(api_key="k0")).identify({"authorization": "Bearer k0"}) is None  # one key: everyone
    header = Clients(_config(client_id_header="X-Team", api_key=("k0", "k1")))
    assert header.identify({"x-team": " red "}) == "id:red"
    assert header.identify({"authorization": "Bearer k1"}) == ANONYMOUS  # the header wins; absent: anonymous
    for bad in ({"max_seqs_per_client": 3}, {"max_tokens_per_client": 3, "api_key": "only"},
                {"client_id_header": "X Client"}, {"client_id_header": ""}, {"api_key": ("k", "")},
                {"api_key": ()}, {"max_seqs_per_client": 0, "client_id_header": "X-C"}):
        with pytest.raises(InvalidConfigError):
            _config(**bad)


def test_several_api_keys_each_open_the_server(tiny_llm):
    async def body(client, front, app):
        return [(await client.get("/v1/models", headers=h)).status_code
                for h in ({"authorization": "Bearer a"}, {"authorization": "Bearer b"},
                          {"authorization": "Bearer c"}, {})]

    codes, _ = run_app(tiny_llm, body, config=_config(api_key=("a", "b")))
    assert codes == [200, 200, 401, 401]


@settings(max_examples=examples(80), deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["a", "b", None]), st.integers(1, 6), st.integers(1, 50),
                              st.booleans()), max_size=40),
       max_seqs=st.integers(1, 8) | st.none(), max_tokens=st.integers(1, 120) | st.none())
def test_random_admits_and_releases_keep_exact_counts(ops, max_seqs, max_tokens):
    clients = Clients(_config(client_id_header="X-C", max_seqs_per_client=max_seqs, max_tokens_per_client=max_tokens))
    model: dict[str, list[int]] = {}
    live = []
    for client, n, tokens, release_one in ops:
        if release_one and live:
            release, who, k, t = live.pop(0)
            release()
            release()  # idempotent
            model[who][0] -= k
            model[who][1] -= t
        key = None if client is None else f"id:{client}"
        have = model.get(key, [0, 0])
        over_alone = key is not None and ((max_seqs is not None and n > max_seqs)
                                          or (max_tokens is not None and tokens > max_tokens))
        over = key is not None and ((max_seqs is not None and have[0] + n > max_seqs)
                                    or (max_tokens is not None and have[1] + tokens > max_tokens))
        try:
            release = clients.admit(key, n, tokens, "prompt")
        except InvalidArgumentError:
            assert over_alone
            continue
        except RateLimitError:
            assert over and not over_alone
            continue
        assert not over
        if key is not None:
            model.setdefault(key, [0, 0])
            model[key][0] += n
            model[key][1] += tokens
            live.append((release, key, n, tokens))
        for who, (k, t) in model.items():
            counted = (max_seqs is not None or max_tokens is not None)
            assert clients.held(who) == ((k, t) if counted else (0, 0))


def test_serve_takes_several_api_keys_by_repeating_the_flag():
    import argparse

    from hybridkv.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--api-key", "a", "m", "--api-key", "b", "--max-seqs-per-client", "3"])
    assert args.model == "m" and args.api_key == ["a", "b"] and args.max_seqs_per_client == 3
    assert _config(api_key=tuple(args.api_key), max_seqs_per_client=3).api_keys == ("a", "b")


def test_a_submission_is_released_once_its_prompts_end_even_if_nobody_reads_it():
    """A response whose reader never started (a client gone in a race) still uncounts its
    client: the last prompt's end reaching the loop releases the submission; close later
    does not release twice, and an early close releases once."""
    from hybridkv.server.submission import Chunk, Submission, deliver

    calls = []
    sub = Submission(lambda s: None, 3, on_close=lambda: calls.append(1))
    final = object()
    deliver([(sub, Chunk(0, "a", (1,))), (sub, Chunk(0, "", (), final=final)), (sub, Chunk(1, "", (), final=final))])
    assert calls == []
    deliver([(sub, Chunk(2, "", (), error=RuntimeError("x")))])
    assert calls == [1]
    sub.close()
    assert calls == [1]
    aborted = []
    early = Submission(lambda s: aborted.append(s), 2, on_close=lambda: calls.append(2))
    early.close()
    deliver([(early, Chunk(0, "", (), final=final)), (early, Chunk(1, "", (), final=final))])
    assert calls == [1, 2] and aborted == [early]
