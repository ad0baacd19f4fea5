"""OpenAI's completions and chat completions over :class:`AsyncLLM`, with no web framework.

A request goes through the same steps on both endpoints, each of which may refuse it
with a typed error before anything is queued (:mod:`hybridkv.protocol.errors` turns them
into OpenAI error bodies): steps 1-4 (the model, the prompt's token ids, the context,
the sampling parameters) are :class:`~hybridkv.server.planning.RequestPlanner`'s; then

5. the client's limits (:mod:`hybridkv.server.clients`: 429 past them) and
   :meth:`AsyncLLM.submit`, which raises the engine's own refusals (a pool too small); the
   prompts take the client's share of the running slots, or the request's own.

Only then does a response start: a JSON body, or server-sent events of OpenAI's chunk
objects ending with ``data: [DONE]``. ``usage.prompt_tokens_details.cached_tokens`` is
the prefix-cache hit of the request's prompts. A completion's ``logprobs.text_offset`` is
each token's character offset in the choice's whole text, streamed or not; a chat's
``echo`` (vLLM's) starts the reply with the last message's content when that message is
the assistant's (:func:`~hybridkv.protocol.openai.chat_echo`; streamed: in the first delta).
A chat's ``tools`` / ``tool_choice`` are :mod:`hybridkv.server.tools`'.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from hybridkv.errors import EngineFailedError, ServiceUnavailableError
from hybridkv.protocol.openai import ChatCompletionRequest, CompletionRequest
from hybridkv.sampling_params import SamplingParams
from hybridkv.server.planning import RequestPlanner
from hybridkv.server.responses import Echo, stop_reason, usage, wire_reason
from hybridkv.server.submission import Chunk, Submission, TokenLogprob
from hybridkv.server.tools import ToolPlan, ToolStream, finish_reason

__all__ = ["OpenAIServing", "sse"]



def _error_event(error: BaseException) -> dict:
    """A stream's error event for a prompt that ended with ``error``: the shutdown deadline's
    503, else an engine failure's 500 (without its detail)."""
    if isinstance(error, ServiceUnavailableError):
        return {"error": {"message": str(error), "type": "server_overloaded", "param": None, "code": 503}}
    return {"error": {"message": "the engine failed while running this request", "type": "server_error",
                      "param": None, "code": 500}}


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

class OpenAIServing(RequestPlanner):
    """The two generation endpoints (step 5 and the responses of the module docstring) over the
    planning of :class:`~hybridkv.server.planning.RequestPlanner`."""

    async def completions(self, req: CompletionRequest, client: str | None = None) -> dict | AsyncIterator[str]:
        n, prompts, params = await self.plan_completion(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        # choice i * n + j: prompt i's sample j (seed + j); SamplingParams.samples: the prompt computed once
        sub = await self._submit([p for p in prompts for _ in range(n)],
                                 [q for p in params for q in replace(p, n=n).samples()],
                                 req.logprobs, rid, client, "n" if n > 1 else "prompt")
        echo = Echo(self.logprobs, req, prompts, n) if req.echo else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            offsets: dict[int, int] = {}  # per choice: the characters of its tokens' texts so far

            def choice(chunk: Chunk, first: bool) -> dict:
                return self._completion_choice(chunk, offsets, req, echo if first else None)

            return self._stream(sub, rid, "text_completion", choice, include_usage, n)
        return await self._collect(sub, rid, "text_completion", chat=False, completion=(req, echo), n=n)

    def _completion_choice(self, chunk: Chunk, offsets: dict[int, int], req: CompletionRequest,
                           echo: "Echo | None" = None) -> dict:
        """A completion choice's chunk (or, with ``echo``, its first: the prompt before it);
        ``text_offset`` goes on from the choice's earlier chunks (``offsets``, updated), so it
        equals the non-streamed response's."""
        prompt = echo.scores(chunk.index, chunk.prompt_logprobs) if echo is not None and req.logprobs is not None else None
        logprobs = self.logprobs.completion(chunk.logprobs if req.logprobs is not None else None,
                                            offsets.get(chunk.index, 0), prompt, req.logprobs or 0)
        if logprobs is not None and logprobs["tokens"]:
            offsets[chunk.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        out = {
            "index": chunk.index,
            "text": (echo.text(chunk.index) if echo is not None else "") + chunk.text,
            "logprobs": logprobs,
            "finish_reason": wire_reason(chunk.final),
            "stop_reason": stop_reason(chunk.final),
        }
        if req.prompt_logprobs is not None and chunk.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.logprobs.prompt_logprobs(chunk.prompt_logprobs, req.prompt_logprobs)
        return out

    async def chat(self, req: ChatCompletionRequest, client: str | None = None) -> dict | AsyncIterator[str]:
        n, plan, prompt, echo, params = await self.plan_chat(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sub = await self._submit([prompt] * n, replace(params, n=n).samples(),
                                 (req.top_logprobs or 0) if req.logprobs else None, rid, client,
                                 "n" if n > 1 else "messages")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            streams: dict[int, ToolStream] = {}  # per choice, with tool calls

            def choice(chunk: Chunk, first: bool) -> dict:
                tools = streams.setdefault(chunk.index, ToolStream(plan)) if plan.calls else None
                return self._chat_choice(chunk, first, echo, req.prompt_logprobs, tools)

            return self._stream(sub, rid, "chat.completion.chunk", choice, include_usage, n)
        return await self._collect(sub, rid, "chat.completion", chat=True, echo=echo, prompt_k=req.prompt_logprobs, n=n,
                                   plan=plan)

    def _chat_choice(self, chunk: Chunk, first: bool, echo: str = "", prompt_k: int | None = None,
                     tools: ToolStream | None = None) -> dict:
        """A streamed chat chunk: the first of a choice carries the role and ``echo`` before its
        text; with ``tools`` its text is split into content and tool call deltas."""
        text, calls = (chunk.text, []) if tools is None else tools.delta(chunk.text, chunk.final is not None)
        delta: dict[str, Any] = {"role": "assistant", "content": echo + text} if first else {}
        if text and not first:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        out = {
            "index": chunk.index,
            "delta": delta,
            "logprobs": self.logprobs.chat(chunk.logprobs),
            "finish_reason": finish_reason(wire_reason(chunk.final), tools is not None and tools.sent > 0),
            "stop_reason": stop_reason(chunk.final),
        }
        if prompt_k is not None and chunk.prompt_logprobs is not None:  # vLLM's, in a choice's first chunk
            out["prompt_logprobs"] = self.logprobs.prompt_logprobs(chunk.prompt_logprobs, prompt_k)
        return out

    async def _submit(self, prompts: list[list[int]], params: list[SamplingParams], logprobs: int | None, rid: str,
                      client: str | None, param: str) -> Submission:
        """Step 5: counted against ``client``'s limits (429 past them; released when the
        submission closes), then submitted, taking ``client``'s share of the running slots
        (none: the request's own)."""
        release = self.clients.admit(client, len(prompts), sum(map(len, prompts)), param)
        try:
            return await self.front.submit(prompts, params, logprobs=logprobs, request_id=rid,
                                           share_key=client if client is not None else rid, on_close=release)
        except BaseException:
            release()
            raise

    # ------------------------------------------------------------ responses
    async def _stream(self, sub: Submission, rid: str, obj: str, choice, include_usage: bool,
                      n: int = 1) -> AsyncIterator[str]:
        created = int(time.time())
        started: set[int] = set()
        finals: dict[int, Any] = {}
        try:
            async for chunk in sub:
                if chunk.error is not None:
                    yield sse(_error_event(chunk.error))
                    continue
                first = chunk.index not in started
                started.add(chunk.index)
                if chunk.final is not None:
                    finals[chunk.index] = chunk.final
                yield sse({"id": rid, "object": obj, "created": created, "model": self.config.model_name,
                           "choices": [choice(chunk, first)]})
            if include_usage:
                yield sse({"id": rid, "object": obj, "created": created, "model": self.config.model_name,
                           "choices": [], "usage": usage(finals, n)})
            yield "data: [DONE]\n\n"
        finally:
            sub.close()

    async def _collect(self, sub: Submission, rid: str, obj: str, chat: bool, echo: str = "",
                       completion: tuple | None = None, prompt_k: int | None = None, n: int = 1,
                       plan: ToolPlan | None = None) -> dict:
        """The whole response of ``sub`` (chat: ``echo`` starts each reply; completions:
        ``completion`` is (the request, its :class:`_Echo` or None))."""
        texts: dict[int, list[str]] = {}
        lps: dict[int, list[TokenLogprob] | None] = {}
        finals: dict[int, Any] = {}
        scored: dict[int, tuple] = {}
        try:
            async for chunk in sub:
                if chunk.error is not None:
                    if isinstance(chunk.error, ServiceUnavailableError):  # ended at the shutdown deadline: 503
                        raise chunk.error
                    raise EngineFailedError("the engine failed while running this request") from chunk.error
                texts.setdefault(chunk.index, []).append(chunk.text)
                if chunk.logprobs is not None:
                    lps.setdefault(chunk.index, []).extend(chunk.logprobs)
                if chunk.prompt_logprobs is not None:
                    scored[chunk.index] = chunk.prompt_logprobs
                if chunk.final is not None:
                    finals[chunk.index] = chunk.final
        finally:
            sub.close()
        choices = []
        for i in sorted(finals):
            out, text = finals[i], "".join(texts.get(i, []))
            if chat:
                content, calls = plan.message(text) if plan is not None and plan.calls else (text, [])
                message = {"role": "assistant", "content": None if content is None and not echo else echo + (content or "")}
                if calls:
                    message["tool_calls"] = calls
                choices.append({"index": i, "message": message,
                                "logprobs": self.logprobs.chat(tuple(lps[i])) if i in lps else None,
                                "finish_reason": finish_reason(wire_reason(out), bool(calls)),
                                "stop_reason": stop_reason(out)})
                if prompt_k is not None:
                    choices[-1]["prompt_logprobs"] = self.logprobs.prompt_logprobs(scored.get(i), prompt_k)
            else:
                req, prompt_echo = completion
                whole = Chunk(i, text, out.token_ids, tuple(lps.get(i, ())), out, prompt_logprobs=scored.get(i))
                choices.append(self._completion_choice(whole, {}, req, prompt_echo))
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.config.model_name,
                "choices": choices, "usage": usage(finals, n)}
