"""The FastAPI app: OpenAI's routes over :class:`OpenAIServing`, ``/health`` and ``/metrics``.

    app = create_app(AsyncLLM(LLM("gemma-3-270m")), ServerConfig(model_name="gemma-3-270m"))
    uvicorn.run(app)           # or: hybridkv serve gemma-3-270m

| route                      | what                                                      |
|----------------------------|-----------------------------------------------------------|
| POST /v1/completions       | text or token-id prompts (a list: one choice each)        |
| POST /v1/chat/completions  | messages through the chat template                        |
| POST /v1/completions/render, /v1/chat/completions/render | vLLM's: the token ids and sampling params generation would run (:mod:`.render`) |
| GET  /v1/models            | the served model (``/v1/models/{id}``: it, or 404)        |
| GET  /health               | 200 while serving, 503 once shutting down                 |
| GET  /metrics              | Prometheus text (:mod:`hybridkv.server.metrics`)          |
| POST /kv_cache/peek        | the prefix-cache hit a prompt would get now (an oracle)   |
| POST /tokenize             | vLLM's: a text's or a chat's token ids (and their count)  |
| POST /detokenize           | vLLM's: token ids' text                                   |
| GET  /tokenizer_info       | vLLM's: special tokens, chat template (404: no tokenizer) |
| GET  /get_load, /get_server_info, /get_model_info, /kv_event_sources, /version | what routers read (:mod:`.info`) |

The lifespan starts the engine thread and, at shutdown (after uvicorn has let open
responses finish), aborts what is left, stops the thread and records the pool's free
blocks in ``app.state.final_blocks``. Every error is OpenAI's JSON error body with the
status of :mod:`hybridkv.protocol.errors`: malformed JSON and wrong types are 400 (not
FastAPI's 422), unknown routes 404, and nothing on the wire carries a traceback. A
client that disconnects aborts its requests, streaming or not: their blocks are freed
before the engine's next step (:func:`~hybridkv.protocol.disconnect.until_done_or_gone`).
With ``api_key`` set (one key or several), every route but :data:`OPEN_PATHS` needs
``Authorization: Bearer KEY``; without it, 401 (``invalid_api_key``). A generation request's
client (:mod:`hybridkv.server.clients`: a client id header, or which of several keys) takes
one share of the running slots and is held to the per-client limits (429). CORS (``config.allowed_origins``, vLLM's default ``*``)
wraps everything, so a browser's preflight ``OPTIONS`` is answered before the key is asked for.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridkv import __version__
from hybridkv.errors import HybridKVError, InvalidArgumentError
from hybridkv.protocol.disconnect import until_done_or_gone
from hybridkv.protocol.errors import error_body, to_response
from hybridkv.protocol.limits import BodyLimit, Offload, loads_json
from hybridkv.protocol.openai import ChatCompletionRequest, CompletionRequest
from hybridkv.protocol.tokenize import DetokenizeRequest, tokenize_request_model
from hybridkv.server.async_llm import AsyncLLM
from hybridkv.server.config import ServerConfig
from hybridkv.server.info import ReplicaInfo
from hybridkv.server.render import OpenAIServingRender
from hybridkv.server.serving import OpenAIServing
from hybridkv.server.tokenization import OpenAIServingTokenization

__all__ = ["create_app"]

log = logging.getLogger("hybridkv.server")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

#: the routes answered without ``--api-key``'s key (load balancers', scrapers' and vllm-router's load
#: poll, which sends no key; as vLLM's); every other path, ``/v1/*`` and ``/kv_cache/peek`` included,
#: needs it (else 401)
OPEN_PATHS = frozenset({"/health", "/metrics", "/get_load", "/version"})


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request body", None
    first = errs[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg', '')}".rstrip(": "), None
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid value')}{more}", param


def parse_body(model: Union[type[BaseModel], Callable[[Any], type[BaseModel]]], raw: bytes,
               precheck: Callable[[Any], None] | None = None) -> BaseModel:
    """The request body as ``model``, as FastAPI would parse it (errors: RequestValidationError
    with FastAPI's ``("body", ...)`` locations; InvalidArgumentError for malformed JSON). A worker
    thread's job: a large body is never parsed on the event loop. ``model`` may be a function
    of the parsed JSON that picks the model (``/tokenize``: a text or a chat); ``precheck(obj)``
    runs on the parsed JSON before validation (cheap refusals: its error propagates)."""
    if not raw.strip():
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        obj = loads_json(raw)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    if precheck is not None:
        precheck(obj)
    if not isinstance(model, type):
        model = model(obj)
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def _error_json(exc: BaseException) -> JSONResponse:
    r = to_response(exc)
    return JSONResponse(r.body, status_code=r.status, headers=r.headers)


def create_app(front: AsyncLLM, config: ServerConfig, metrics: Any = None) -> FastAPI:
    """The app serving ``front``'s model as ``config.model_name`` (see the module docstring)."""
    offload = Offload()
    serving = OpenAIServing(front, config, offload)
    clients = serving.clients
    tokenization = OpenAIServingTokenization(serving)
    render = OpenAIServingRender(serving)
    info = ReplicaInfo(front, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        front.start()
        yield
        app.state.final_blocks = await front.shutdown()
        offload.close()
        free, usable = app.state.final_blocks
        log.info("engine stopped: %d of %d blocks free", free, usable)

    app = FastAPI(title="hybridkv", version=__version__, lifespan=lifespan)
    app.state.front = front
    app.state.serving = serving
    app.state.tokenization = tokenization
    app.state.info = info
    app.state.config = config
    app.state.metrics = metrics
    app.state.final_blocks = None
    # 413 before anything parses a body: its bytes, or more values than any request can use
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes, max_values=serving.max_body_values)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(HybridKVError)
    async def _hybridkv(request: Request, exc: HybridKVError):
        return _error_json(exc)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        return _error_json(exc)

    if config.api_keys:
        accepted = frozenset(f"Bearer {key}" for key in config.api_keys)

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.url.path not in OPEN_PATHS:
                if request.headers.get("authorization", "") not in accepted:
                    return JSONResponse(
                        error_body("invalid or missing API key", "invalid_request_error", None, "invalid_api_key"),
                        status_code=401,
                    )
            return await call_next(request)

    async def _generate(request: Request, run) -> Response:
        result = await until_done_or_gone(request, run)
        if result is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers=_SSE_HEADERS)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await offload.run(parse_body, CompletionRequest, await request.body(), serving.precheck_completion)
        return await _generate(request, serving.completions(body, clients.identify(request.headers)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await offload.run(parse_body, ChatCompletionRequest, await request.body())
        return await _generate(request, serving.chat(body, clients.identify(request.headers)))

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> Response:
        body = await offload.run(parse_body, CompletionRequest, await request.body(), serving.precheck_completion)
        return JSONResponse(await render.completions(body))

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(request: Request) -> Response:
        body = await offload.run(parse_body, ChatCompletionRequest, await request.body())
        return JSONResponse(await render.chat(body))

    @app.post("/kv_cache/peek")
    async def kv_cache_peek(request: Request) -> Response:
        try:
            body = await offload.run(loads_json, await request.body())
        except ValueError:
            return JSONResponse(error_body("malformed JSON body", "invalid_request_error"), status_code=400)
        return JSONResponse(await serving.peek(body))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await offload.run(parse_body, tokenize_request_model, await request.body())
        return JSONResponse(await tokenization.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await offload.run(parse_body, DetokenizeRequest, await request.body())
        return JSONResponse(await tokenization.detokenize(body))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        info = tokenization.info()
        if info is None:  # clients (lm-eval) then use their own tokenizer
            return JSONResponse(error_body("this model has no tokenizer", "invalid_request_error"), status_code=404)
        return JSONResponse(info)

    @app.get("/v1/models")
    async def models() -> dict:
        return serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        serving._check_model(model_id)  # another name: 404 model_not_found
        return serving.models()["data"][0]

    @app.get("/version")
    async def version() -> dict:
        return info.version()

    @app.get("/get_load")
    async def get_load() -> dict:
        return info.load()

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        return info.server_info()

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return info.model_info()

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> Response:
        sources = info.kv_event_sources()
        if sources is None:
            return JSONResponse(error_body("KV cache events are off (serve --kv-events)", "invalid_request_error"),
                                status_code=404)
        return JSONResponse(sources)

    @app.get("/health")
    async def health() -> Response:
        if not front.accepting:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if metrics is None:
            return JSONResponse(error_body("metrics are off", "invalid_request_error"), status_code=404)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    if config.allowed_origins:  # added last: the outermost layer, before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])  # the key is a header, never a cookie: no credentials
    return app
