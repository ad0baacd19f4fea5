"""vLLM's render routes: a request turned into what the engine would run, without running it.

| route                            | body                    | answer                                  |
|----------------------------------|-------------------------|-----------------------------------------|
| POST /v1/completions/render      | a completions request   | a JSON array: one item per prompt       |
| POST /v1/chat/completions/render | a chat request          | one item                                |

An item is vLLM 0.34's ``GenerateRequest`` (``entrypoints/scale_out``): ``request_id``,
``token_ids`` (the prompt's ids: text tokenized as generation tokenizes it, a chat through
the same chat template, tools included), ``features`` (null: no multimodal input),
``sampling_params`` (vLLM's names, the values generation would use: defaults filled in,
the model's EOS ids added to ``stop_token_ids`` unless ``ignore_eos``), ``model``,
``stream``, ``stream_options``, ``cache_salt`` (null), ``priority`` (0). A request is
checked exactly as generation checks it (model, unsupported fields, the context, every
sampling range, a grammar that does not compile), with the same 4xx errors, and nothing
is queued. KV-aware routers call these with the client's body to learn the prompt's
tokens (vllm-router's ``kv_aware``: each item needs ``token_ids``, and ``features`` null).

Example (a completions request with two prompts)::

    POST /v1/completions/render {"prompt": ["Hi", "Yo"], "max_tokens": 4}
    -> [{"request_id": "cmpl-...-0", "token_ids": [1, 9088], "features": null,
         "sampling_params": {"n": 1, "max_tokens": 4, ...}, "model": null, "stream": false, ...},
        {"request_id": "cmpl-...-1", "token_ids": [1, 57, 78], ...}]
"""

from __future__ import annotations

import uuid
from typing import Any

from hybridkv.protocol.openai import ChatCompletionRequest, CompletionRequest
from hybridkv.sampling_params import SamplingParams
from hybridkv.server.serving import OpenAIServing

__all__ = ["OpenAIServingRender", "vllm_sampling_params"]


def vllm_sampling_params(params: SamplingParams, n: int, logprobs: int | None) -> dict[str, Any]:
    """``params`` under vLLM's ``SamplingParams`` field names (``logprobs``: the top
    alternatives per output token, None: off; ``n``: samples of the prompt)."""
    so = params.structured_outputs
    structured = None
    if so is not None:
        structured = {k: (list(v) if isinstance(v, tuple) else v) for k, v in (
            ("json", so.json), ("json_object", so.json_object or None), ("regex", so.regex),
            ("choice", so.choice), ("grammar", so.grammar)) if v is not None}
    return {
        "n": n,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "logit_bias": {str(t): b for t, b in params.logit_bias} or None,
        "structured_outputs": structured,
    }


class OpenAIServingRender:
    """The render routes over ``serving``'s checks and tokenizer (see the module docstring)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _item(self, rid: str, ids: list[int], params: SamplingParams, n: int, logprobs: int | None, req) -> dict:
        return {
            "request_id": rid,
            "token_ids": ids,
            "features": None,
            "sampling_params": vllm_sampling_params(params, n, logprobs),
            "model": req.model,
            "stream": req.stream,
            "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
            "cache_salt": None,
            "priority": 0,
        }

    async def completions(self, req: CompletionRequest) -> list[dict]:
        n, prompts, params = await self.serving.plan_completion(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return [self._item(f"{rid}-{i}", ids, p, n, req.logprobs, req) for i, (ids, p) in enumerate(zip(prompts, params))]

    async def chat(self, req: ChatCompletionRequest) -> dict:
        n, _, prompt, _, params = await self.serving.plan_chat(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return self._item(f"chatcmpl-{uuid.uuid4().hex}", prompt, params, n, logprobs, req)
