"""vLLM's tokenizer routes over the served model's tokenizer (shapes: :mod:`hybridkv.protocol.tokenize`).

| route                | answer                                                                  |
|----------------------|-------------------------------------------------------------------------|
| POST /tokenize       | ``count``, ``max_model_len``, ``tokens``, ``token_strs`` (null unless asked) |
| POST /detokenize     | ``prompt``: the ids' text, special tokens kept (as vLLM decodes)        |
| GET  /tokenizer_info | the tokenizer's class, special tokens, ``model_max_length``, chat template |

A text is encoded as given (``add_special_tokens``: BOS unless false); chat messages go
through :func:`~hybridkv.protocol.openai.chat_messages` and the chat template as on
``/v1/chat/completions``, so that a chat's ``count`` with the defaults is the
``prompt_tokens`` that route reports (``add_generation_prompt: false`` is honoured here).
A text that cannot fit the context whatever its tokens is refused before it is tokenized
(400 ``context_length_exceeded``, as on completions); below that, ``count`` may exceed
``max_model_len``, which the answer carries for the client to compare (lm-eval tokenizes
whole documents and windows them itself). Encoding and decoding run on the server's
worker threads (:class:`~hybridkv.protocol.limits.Offload`), never on the event loop.

``/detokenize`` refuses ids outside the model's vocabulary (400 naming ``tokens``); ids
past the tokenizer's own (a model's padded rows) have no text, as in generated output.

A model without a tokenizer (token ids only): ``/tokenize`` and ``/detokenize`` are a 400
naming ``prompt`` / ``messages`` / ``tokens``; :meth:`OpenAIServingTokenization.info` is
None and ``GET /tokenizer_info`` a 404, so that clients (lm-eval's remote tokenizer) fall
back to their own. lm-eval 0.4's ``RemoteTokenizer`` needs ``eos_token`` from
``/tokenizer_info`` and ``tokens`` from ``/tokenize`` (``{"prompt", "add_special_tokens":
false}``), and reads ``prompt`` from ``/detokenize`` (``{"tokens"}``); the EOS text it gets
encodes back to the EOS id.
"""

from __future__ import annotations

from typing import Any

from hybridkv.errors import InvalidArgumentError
from hybridkv.protocol.openai import chat_messages, valid_text
from hybridkv.protocol.tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    tokenize_unsupported,
)
from hybridkv.server.serving import OpenAIServing
from hybridkv.tokenizer.prompts import check_token_ids

__all__ = ["OpenAIServingTokenization"]


class OpenAIServingTokenization:
    """The tokenizer routes of ``serving``'s model (see the module docstring)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.llm = serving.llm
        self.max_model_len = serving.max_model_len

    def _tokenizer(self, param: str, what: str) -> Any:
        tok = self.llm.tokenizer
        if tok is None:
            raise InvalidArgumentError(
                f"{what} needs a tokenizer; this model has none (it takes token-id prompts only)", param=param
            )
        return tok

    # ------------------------------------------------------------ /tokenize
    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """``POST /tokenize``: the model name checked (404), unsupported chat fields refused
        (400 naming them), then the ids, tokenized on a worker thread."""
        self.serving._check_model(req.model)
        bad = tokenize_unsupported(req)
        if bad is not None:
            raise InvalidArgumentError(bad[1], param=bad[0])
        return await self.serving.offload.run(self._tokenize, req)

    def _tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        chat = isinstance(req, TokenizeChatRequest)
        param = "messages" if chat else "prompt"
        tok = self._tokenizer(param, "tokenization")
        try:
            if chat:
                # the chat route's messages (roles, content parts, Unicode checks); it refuses
                # add_generation_prompt=false for generation, which tokenizing can honour
                messages = chat_messages(req.model_copy(update={"add_generation_prompt": True}))
                self.serving._check_text_length(sum(len(m["content"]) for m in messages), param)
                text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
            else:
                text = valid_text(req.prompt, param, "the prompt")
                self.serving._check_text_length(len(text), param)
            ids = list(tok.encode(text, add_special_tokens=req.add_special_tokens))
        except InvalidArgumentError as exc:  # a template that raises, a malformed message
            if exc.param is None:
                exc.param = param
            raise
        return {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": list(tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None,
        }

    # ------------------------------------------------------------ /detokenize
    async def detokenize(self, req: DetokenizeRequest) -> dict:
        """``POST /detokenize``: ``{"prompt": text}`` of ``req.tokens`` (decoded on a worker thread)."""
        self.serving._check_model(req.model)
        return {"prompt": await self.serving.offload.run(self._detokenize, req.tokens)}

    def _detokenize(self, ids: list[int]) -> str:
        tok = self._tokenizer("tokens", "detokenization")
        check_token_ids(ids, self.llm.model.vocab_size, param="tokens")
        return tok.decode([t for t in ids if t < tok.vocab_size], skip_special_tokens=False)

    # ------------------------------------------------------------ /tokenizer_info
    def info(self) -> dict | None:
        """``GET /tokenizer_info``: what vLLM answers (``tokenizer_class``, the special tokens'
        texts, ``model_max_length``, ``chat_template`` when the model has one) plus
        ``max_model_len`` and ``vocab_size``; None when the model has no tokenizer. A special
        token the tokenizer files do not name is its id's token text (null without an id)."""
        tok = self.llm.tokenizer
        if tok is None:
            return None
        named = dict(getattr(tok, "special_tokens", None) or {})

        def text(name: str, token_id: int | None) -> str | None:
            if named.get(name) is not None:
                return named[name]
            return None if token_id is None else tok.convert_ids_to_tokens([token_id])[0]

        eos_ids = tuple(tok.eos_token_ids)
        info: dict[str, Any] = {
            "tokenizer_class": type(tok).__name__,
            "bos_token": text("bos_token", tok.bos_token_id),
            "eos_token": text("eos_token", eos_ids[0] if eos_ids else None),
            "unk_token": named.get("unk_token"),
            "pad_token": named.get("pad_token"),
            "model_max_length": self.max_model_len,
            "max_model_len": self.max_model_len,
            "vocab_size": tok.vocab_size,
        }
        if tok.chat_template:
            info["chat_template"] = tok.chat_template
        return info
