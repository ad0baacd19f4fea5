"""Steps 1-4 of a generation request, with no web framework: what :class:`~hybridkv.server.serving.OpenAIServing`
runs before anything is queued, and what the render routes (:mod:`.render`) answer with.

Each step may refuse the request with a typed error (:mod:`hybridkv.protocol.errors` turns
them into OpenAI error bodies):

1. the model name (``None`` means the served model), and the parameters hybridkv cannot
   honour (:func:`~hybridkv.protocol.openai.unsupported`);
2. the prompt's token ids: text with the tokenizer's special tokens, a chat through the
   chat template (a template that raises is a 400), or token ids as given (their count
   checked before any is read: :meth:`RequestPlanner.check_prompt_sizes`, on the raw JSON
   too, before it is validated);
3. the context: ``max_tokens`` >= 1 and prompt + ``max_tokens`` <= ``max_model_len``
   (the default ``max_tokens`` is 16 for completions, as OpenAI; the rest of the
   context for chat, as vLLM);
4. :class:`SamplingParams` from the request, each range checked with the parameter's name
   (a ``response_format`` / ``structured_outputs`` grammar compiled: one that does not is a
   400 naming the field it came in).

``/kv_cache/peek`` (the prefix-cache oracle) shares steps 2 and 3. Tokenization, template
rendering and grammar compiles run on the ``offload`` pool, never on the event loop.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from hybridkv.errors import InvalidArgumentError, ModelNotFoundError, PromptTooLongError
from hybridkv.protocol.limits import Offload
from hybridkv.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_echo,
    chat_messages,
    chat_tools,
    completion_prompt_list,
    structured_outputs_of,
    unsupported,
)
from hybridkv.sampling_params import MAX_LOGPROBS, SamplingParams, check_context
from hybridkv.server.async_llm import AsyncLLM
from hybridkv.server.clients import Clients
from hybridkv.server.config import ServerConfig
from hybridkv.server.logprobs import LogprobFormat
from hybridkv.server.responses import prompt_scoring
from hybridkv.server.tools import ToolPlan, tool_plan
from hybridkv.tokenizer.prompts import check_token_ids, encode_prompt, min_tokens

__all__ = ["RequestPlanner"]

class RequestPlanner:
    """Steps 1-4 of the module docstring, ``/v1/models`` and the peek oracle; subclassed by
    :class:`~hybridkv.server.serving.OpenAIServing`."""


    def __init__(self, front: AsyncLLM, config: ServerConfig, offload: Offload | None = None) -> None:
        self.front = front
        self.config = config
        #: where tokenization runs: worker threads, never the event loop
        self.offload = offload if offload is not None else Offload()
        self.llm = front.llm
        self.logprobs = LogprobFormat(self.llm.tokenizer)
        self.max_model_len = front.engine.max_model_len
        self.created = int(time.time())
        #: the most JSON values a request can use: each of ``max_prompts_per_request`` prompts at
        #: ``max_model_len`` token ids, and a list of every token id (``stop_token_ids``, an enum); a
        #: body with more is refused as it arrives (:class:`~hybridkv.protocol.limits.BodyLimit`)
        self.max_body_values = config.max_prompts_per_request * self.max_model_len + self.llm.model.vocab_size
        #: who a request is from, what each client holds (:mod:`hybridkv.server.clients`)
        self.clients = Clients(config)

    # ------------------------------------------------------------ models
    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.config.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "hybridkv",
                    "root": self.config.model_name,
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {self.config.model_name!r}")

    # ------------------------------------------------------------ parsing
    def _sampling(self, req, prompt_len: int, default_max: int | None, plan: ToolPlan | None = None) -> SamplingParams:
        """The request's sampling parameters in OpenAI's meanings (temperature 1 and no
        ``max_tokens``: the rest of the context, unless ``default_max``); SamplingParams checks
        each range and names the parameter, check_context the fit."""
        max_tokens = req.max_tokens
        if getattr(req, "max_completion_tokens", None) is not None:
            max_tokens = req.max_completion_tokens
        check_context(prompt_len, 1, self.max_model_len)  # room for one output token
        if max_tokens is None:
            room = self.max_model_len - prompt_len
            max_tokens = room if default_max is None else min(default_max, room)
        # (fields, the parameter that gave them) or None; a tool_choice may constrain the output
        structured = structured_outputs_of(req) if plan is None else plan.structured(req)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,  # -1: off, as vLLM
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=req.seed,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                stop=() if req.stop is None else req.stop,
                presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
                frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias=req.logit_bias,
                min_tokens=req.min_tokens or 0,
                structured_outputs=None if structured is None else structured[0],
            )
            if params.structured_outputs is not None:  # compiled (and cached) here: a bad schema is a 400
                self.llm.engine.structured.matcher(params.structured_outputs)
        except InvalidArgumentError as exc:  # name the field the client sent
            if exc.param == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
                exc.param = "max_completion_tokens"
            if exc.param == "structured_outputs" and structured is not None:
                exc.param = structured[1]
            raise
        check_context(prompt_len, params.max_tokens, self.max_model_len)
        if params.stop and self.llm.tokenizer is None:
            raise InvalidArgumentError("stop strings need a tokenizer; this model has none", param="stop")
        return params.with_eos(self.llm.eos_token_ids)

    def _check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit the context whatever its tokens
        (:func:`~hybridkv.tokenizer.prompts.min_tokens`): a 20 MB prompt costs nothing."""
        at_least = min_tokens(self.llm.tokenizer, num_chars)
        if at_least >= self.max_model_len:
            exc = PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; a prompt of "
                f"{num_chars:,} characters is at least {at_least:,} tokens"
            )
            exc.param = param  # OpenAI names the field of an over-long input
            raise exc

    def _encode(self, prompt: Any, param: str, tools: list | None = None) -> list[int]:
        if isinstance(prompt, str):
            self._check_text_length(len(prompt), param)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            self._check_text_length(sum(len(m.get("content") or "") for m in prompt if isinstance(m, dict)), param)
        try:
            return encode_prompt(self.llm.tokenizer, prompt, self.llm.model.vocab_size, tools)
        except InvalidArgumentError as exc:
            if exc.param is None:
                exc.param = param
            raise

    def _prepare(self, req) -> None:
        """The checks that need no tokenizer: the model, unsupported fields, the logprobs ranges."""
        self._check_model(req.model)
        bad = unsupported(req)
        if bad is not None:
            raise InvalidArgumentError(bad[1], param=bad[0])
        if isinstance(req, CompletionRequest):
            if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
                raise InvalidArgumentError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}",
                                           param="logprobs")
            return
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise InvalidArgumentError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", param="top_logprobs"
            )
        if req.top_logprobs and not req.logprobs:
            raise InvalidArgumentError("top_logprobs needs logprobs=true", param="top_logprobs")

    # ------------------------------------------------------------ oracle
    async def peek(self, body: dict) -> dict:
        """``POST /kv_cache/peek``: ``{"prompt": text | ids}`` or ``{"messages": [...]}`` ->
        ``{"prompt_tokens": n, "cached_tokens": hit}``: the prefix-cache hit a request with
        this prompt would get now (valid for every group). For routers' oracles and tests. A
        prompt that leaves no room for an output token in ``max_model_len`` is refused as
        generation refuses it (400 ``context_length_exceeded``), token ids before they are read."""
        if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
            raise InvalidArgumentError('give "prompt" (text or token ids) or "messages"', param="prompt")
        param = "messages" if "messages" in body else "prompt"
        try:
            if "messages" in body:
                ids = await self.offload.run(lambda: self.chat_prompt(ChatCompletionRequest(messages=body["messages"])))
            else:
                self.precheck_completion(body)  # lengths only; validating the ids runs off the event loop
                ids = await self.offload.run(lambda: self._one_prompt(CompletionRequest(prompt=body["prompt"])))
        except ValidationError as exc:
            err = exc.errors()[0]  # where, as the generation routes say it: messages.0.role
            where = ".".join(str(p) for p in err.get("loc", ())) if param == "messages" else param
            raise InvalidArgumentError(f"{where or param}: {err.get('msg', 'invalid value')}", param=param) from None
        check_context(len(ids), 1, self.max_model_len)  # a prompt no request could run: refused, as generation
        return {"prompt_tokens": len(ids), "cached_tokens": await self.front.peek_prefix_hit(ids)}

    def _one_prompt(self, req: CompletionRequest) -> list[int]:
        """The token ids of a peek's one prompt (several: InvalidArgumentError, before any is tokenized)."""
        prompts = completion_prompt_list(req)
        if len(prompts) != 1:
            raise InvalidArgumentError(f"give one prompt, got {len(prompts)}", param="prompt")
        [ids] = self.completion_prompts(req)
        return ids

    def _n(self, req, num_prompts: int) -> int:
        """The request's ``n`` (``null``: 1): an int >= 1 whose samples of all prompts fit
        ``max_prompts_per_request``."""
        n = 1 if req.n is None else req.n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(f"n must be an int >= 1, got {n!r}", param="n")
        if n > 1 and n * num_prompts > self.config.max_prompts_per_request:  # n = 1: the prompt list's own limit
            raise InvalidArgumentError(f"n={n} samples of {num_prompts} prompt(s) exceed the "
                                       f"{self.config.max_prompts_per_request} sequences a request may ask for", param="n")
        return n

    # ------------------------------------------------------------ completions
    def check_prompt_sizes(self, prompts: list) -> None:
        """Lengths only, before any id is looked at or any text tokenized: at most
        ``max_prompts_per_request`` prompts, each list of token ids leaving room for an output token."""
        if len(prompts) > self.config.max_prompts_per_request:
            raise InvalidArgumentError(
                f"{len(prompts)} prompts in one request; at most {self.config.max_prompts_per_request}", param="prompt"
            )
        for x in prompts:
            if isinstance(x, list):
                check_context(len(x), 1, self.max_model_len)

    def precheck_completion(self, obj: Any) -> None:
        """:meth:`check_prompt_sizes` on a completions body's parsed JSON before it is validated
        (validating 1M token ids costs what parsing them does, again)."""
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if isinstance(prompt, list) and prompt:
            self.check_prompt_sizes(prompt if isinstance(prompt[0], (list, str)) else [prompt])

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompts = completion_prompt_list(req)
        self.check_prompt_sizes(prompts)
        ids = [self._encode(x, "prompt") for x in prompts]
        for x in ids:  # all of them before any is submitted
            check_token_ids(x, self.llm.model.vocab_size, param="prompt")
        return ids

    async def plan_completion(self, req: CompletionRequest) -> tuple[int, list[list[int]], list[SamplingParams]]:
        """Steps 1-4 of a completions request (module docstring): ``(n, each prompt's ids, each
        prompt's params)``, or the 4xx error; nothing queued (the render route's answer too)."""
        self._prepare(req)
        n = self._n(req, len(completion_prompt_list(req)))
        prompts = await self.offload.run(self.completion_prompts, req)  # tokenized off the event loop
        score = prompt_scoring(req, echo_logprobs=req.echo and req.logprobs is not None)
        # off the loop too: a structured request's grammar compiles here
        params = await self.offload.run(lambda: [self._sampling(req, len(p), 16) for p in prompts])
        if score is not None:
            params = [replace(p, prompt_logprobs=score) for p in params]
        return n, prompts, params

    # ------------------------------------------------------------ chat
    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        # the tokenizer's ids fit the model's vocabulary (LLM checks it once, check_vocab)
        return self._encode(chat_messages(req), "messages", chat_tools(req))

    def _chat_prompt_and_echo(self, req: ChatCompletionRequest, plan: ToolPlan) -> tuple[list[int], str]:
        """:meth:`chat_prompt` and what the reply starts with (``echo``; "" without)."""
        messages = chat_messages(req)
        return self._encode(messages, "messages", plan.tools), chat_echo(req, messages)

    async def plan_chat(self, req: ChatCompletionRequest) -> tuple[int, ToolPlan, list[int], str, SamplingParams]:
        """Steps 1-4 of a chat request: ``(n, its tool plan, the prompt's ids, echo, params)``, or
        the 4xx error; nothing queued (the render route's answer too)."""
        self._prepare(req)
        n = self._n(req, 1)
        plan = tool_plan(req, self.config.tool_call_parser)
        prompt, echo = await self.offload.run(self._chat_prompt_and_echo, req, plan)  # rendered and tokenized off the loop
        params = await self.offload.run(self._sampling, req, len(prompt), None, plan)  # a grammar compiles off the loop
        score = prompt_scoring(req, echo_logprobs=False)
        if score is not None:
            params = replace(params, prompt_logprobs=score)
        return n, plan, prompt, echo, params
