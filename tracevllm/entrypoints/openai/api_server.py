"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM.

Mirrors vllm/entrypoints/openai/api_server.py (``build_app``,
``init_app_state``, ``run_server``), with the pieces vLLM keeps beside it:
the routes of each endpoint's ``api_router.py``, the error handlers and
``AuthenticationMiddleware`` of vllm/entrypoints/openai/server_utils.py and ``with_cancellation``
of vllm/entrypoints/utils.py; uvicorn and the engine-death watchdog run in
entrypoints/launcher.py (``serve_http``), as in vLLM. Endpoints: GET /v1/models, POST
/v1/completions, POST /v1/chat/completions, GET /health, GET /version,
POST /tokenize, POST /detokenize, GET /metrics.

tracevllm's own: a request body over ``--max-request-body-size`` is a 413
(vLLM leaves that to a proxy), and the server binds 127.0.0.1 unless told
otherwise (vLLM binds every interface). Left out: SSL, CORS options, LoRA,
the Responses, embeddings and other APIs, multiple API-server processes.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hmac
import os
import socket
from argparse import Namespace
from collections.abc import AsyncGenerator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import State
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import tracevllm
from tracevllm import envs
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.engine.async_llm import AsyncLLM
from tracevllm.engine.exceptions import EngineDeadError
from tracevllm.entrypoints.launcher import serve_http
from tracevllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from tracevllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from tracevllm.entrypoints.openai.completion.protocol import CompletionRequest
from tracevllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from tracevllm.entrypoints.openai.engine.protocol import ErrorInfo, ErrorResponse
from tracevllm.entrypoints.openai.engine.serving import create_error_response
from tracevllm.entrypoints.openai.models.serving import BaseModelPath, OpenAIServingModels
from tracevllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tracevllm.entrypoints.serve.tokenize.serving import OpenAIServingTokenization
from tracevllm.exceptions import VLLMValidationError
from tracevllm.logger import init_logger
from tracevllm.metrics.loggers import PrometheusStatLogger
from tracevllm.utils.system_utils import set_ulimit

logger = init_logger(__name__)


# --8<-- [start:with_cancellation]
def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Cancel a handler when its client disconnects (vLLM's decorator).

    A non-streamed request waits for its whole completion: if the client
    hangs up meanwhile, the handler task is cancelled, and with it the
    request's generate(), which aborts it in the engine. (A streamed response
    notices the disconnect itself.)
    """

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        raw_request: Request = kwargs["raw_request"]
        handler_task: asyncio.Future[Any] = asyncio.ensure_future(handler(*args, **kwargs))
        cancellation_task = asyncio.create_task(listen_for_disconnect(raw_request))
        done, pending = await asyncio.wait(
            [handler_task, cancellation_task], return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        if handler_task in done:
            return handler_task.result()
        return None

    return wrapper


async def listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# --8<-- [end:with_cancellation]


async def validate_json_request(raw_request: Request) -> None:
    """POST bodies must say they are JSON (vLLM's dependency of the same name)."""
    content_type = raw_request.headers.get("content-type", "").lower()
    media_type = content_type.split(";", maxsplit=1)[0].strip()
    if media_type != "application/json":
        raise StarletteHTTPException(
            status_code=HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
            detail="Unsupported Media Type: only 'application/json' is allowed "
            "(send the header 'Content-Type: application/json').",
        )


def _json(response: Any) -> JSONResponse:
    if isinstance(response, ErrorResponse):
        return JSONResponse(response.model_dump(), status_code=response.error.code)
    return JSONResponse(response.model_dump())


def _generation_response(generator: Any) -> Response:
    if isinstance(generator, AsyncGenerator):
        return StreamingResponse(generator, media_type="text/event-stream")
    return _json(generator)


# --8<-- [start:routes]
def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(raw_request: Request) -> Response:
        """200 while the engine lives; 503 once it is dead."""
        try:
            await raw_request.app.state.engine_client.check_health()
        except EngineDeadError:
            return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=HTTPStatus.OK)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": tracevllm.__version__})

    @app.get("/metrics")
    async def metrics(raw_request: Request) -> Response:
        body = raw_request.app.state.stat_logger.render()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def show_available_models(raw_request: Request) -> JSONResponse:
        models = await raw_request.app.state.openai_serving_models.show_available_models()
        return JSONResponse(models.model_dump())

    @app.post("/v1/completions", dependencies=[Depends(validate_json_request)])
    @with_cancellation
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        handler: OpenAIServingCompletion = raw_request.app.state.openai_serving_completion
        return _generation_response(await handler.create_completion(request, raw_request))

    @app.post("/v1/chat/completions", dependencies=[Depends(validate_json_request)])
    @with_cancellation
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        handler: OpenAIServingChat = raw_request.app.state.openai_serving_chat
        return _generation_response(await handler.create_chat_completion(request, raw_request))

    @app.post("/tokenize", dependencies=[Depends(validate_json_request)])
    async def tokenize(
        request: TokenizeCompletionRequest | TokenizeChatRequest, raw_request: Request
    ) -> JSONResponse:
        handler: OpenAIServingTokenization = raw_request.app.state.openai_serving_tokenization
        return _json(await handler.create_tokenize(request))

    @app.post("/detokenize", dependencies=[Depends(validate_json_request)])
    async def detokenize(request: DetokenizeRequest, raw_request: Request) -> JSONResponse:
        handler: OpenAIServingTokenization = raw_request.app.state.openai_serving_tokenization
        return _json(await handler.create_detokenize(request))


# --8<-- [end:routes]


# --- errors ------------------------------------------------------------------
async def validation_exception_handler(req: Request, exc: Exception) -> JSONResponse:
    """A body that is not JSON, or a field of the wrong type or shape: a 400
    naming the parameter (OpenAI's error object, not FastAPI's 422)."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    # loc is ("body", field, ...), with the model's name in it for a union of
    # request kinds (/tokenize); a JSON syntax error has no field.
    loc = [
        str(part)
        for part in first.get("loc", ())[1:]
        if isinstance(part, str) and not part[:1].isupper()
    ]
    param = loc[0] if loc else None
    ctx_error = first.get("ctx", {}).get("error")
    if isinstance(ctx_error, VLLMValidationError):
        # A request model's own check: its parameter and message (vLLM's rule).
        param, message = ctx_error.parameter, str(ctx_error)
    elif first.get("type") == "json_invalid":
        message = f"The request body is not valid JSON: {first.get('msg')}"
    elif first.get("type") == "missing" and not loc:
        message = "The request body is empty: send a JSON object with the request's fields."
    else:
        located = []
        for e in errors:
            where = ".".join(str(p) for p in e.get("loc", ())[1:])
            located.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        message = "; ".join(located)
    err = ErrorResponse(
        error=ErrorInfo(message=message, type="BadRequestError", param=param, code=400)
    )
    return JSONResponse(err.model_dump(), status_code=HTTPStatus.BAD_REQUEST)


async def http_exception_handler(req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    err = ErrorResponse(
        error=ErrorInfo(
            message=str(exc.detail), type=error_type(exc.status_code), code=exc.status_code
        )
    )
    return JSONResponse(err.model_dump(), status_code=exc.status_code)


def error_type(status_code: int) -> str:
    """OpenAI's naming: 404 -> NotFoundError, 413 -> RequestEntityTooLargeError."""
    return HTTPStatus(status_code).phrase.replace(" ", "") + "Error"


async def exception_handler(req: Request, exc: Exception) -> JSONResponse:
    """Anything else (EngineDeadError included): OpenAI's error object, 500 or 400."""
    err = create_error_response(exc)
    return JSONResponse(err.model_dump(), status_code=err.error.code)


# --- middleware --------------------------------------------------------------
class AuthenticationMiddleware:
    """With --api-key: every /v1 request needs ``Authorization: Bearer KEY``
    (a plain ASGI middleware, as vLLM's, so streaming is untouched)."""

    def __init__(self, app: ASGIApp, tokens: list[str]) -> None:
        self.app = app
        self.api_tokens = [f"Bearer {token}".encode() for token in tokens]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if not any(hmac.compare_digest(given, token) for token in self.api_tokens):
            err = ErrorResponse(
                error=ErrorInfo(
                    message="Unauthorized: send the server's API key as 'Authorization: "
                    "Bearer KEY'.",
                    type="AuthenticationError",
                    code=HTTPStatus.UNAUTHORIZED,
                )
            )
            response = JSONResponse(err.model_dump(), status_code=HTTPStatus.UNAUTHORIZED)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class RequestSizeLimitMiddleware:
    """A body over ``max_bytes`` is a 413, whether it says its length or not."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        received = 0

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside FastAPI's body read: it passes an
                    # HTTPException through, to http_exception_handler.
                    raise StarletteHTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self.detail)
            return message

        await self.app(scope, limited_receive, send)

    @property
    def detail(self) -> str:
        return f"The request body is larger than {self.max_bytes} bytes (--max-request-body-size)."

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        code = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
        err = ErrorResponse(error=ErrorInfo(message=self.detail, type=error_type(code), code=code))
        await JSONResponse(err.model_dump(), status_code=code)(scope, receive, send)


def served_names(args: Namespace) -> list[str]:
    """The names clients use: --served-model-name, else --model as given
    (vLLM's rule), else the default model's name."""
    from tracevllm.model_executor.model_loader import DEFAULT_MODEL_NAME

    return list(args.served_model_name or [args.model or DEFAULT_MODEL_NAME])


# --8<-- [start:build_app]
def build_app(args: Namespace) -> FastAPI:
    """The FastAPI app: routes, error handlers, the API key and the body limit."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    _add_routes(app)
    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(Exception, exception_handler)
    if args.api_key:
        app.add_middleware(AuthenticationMiddleware, tokens=[args.api_key])
    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=args.max_request_body_size)
    return app


def init_app_state(engine_client: AsyncLLM, state: State, args: Namespace) -> None:
    """The handlers, made once, shared by every request (``app.state``)."""
    model_path = engine_client.model_config.model
    served_model_names = served_names(args)
    models = OpenAIServingModels(
        [BaseModelPath(name=name, model_path=model_path) for name in served_model_names],
        engine_client.model_config.get_max_model_len(),
    )
    state.engine_client = engine_client
    state.openai_serving_models = models
    trusted = args.trust_request_chat_template
    state.openai_serving_completion = OpenAIServingCompletion(engine_client, models)
    state.openai_serving_chat = OpenAIServingChat(engine_client, models, trusted)
    state.openai_serving_tokenization = OpenAIServingTokenization(engine_client, models, trusted)


# --8<-- [end:build_app]


# --8<-- [start:run_server]
async def run_server(args: Namespace, **uvicorn_kwargs: Any) -> int:
    """Start the engine, serve until Ctrl-C / SIGTERM or the engine's death.

    Returns the exit code: 0 after a shutdown asked for, 1 if the engine died
    (in-flight requests get an error, /health answers 503, and the server
    stops instead of hanging, as vLLM's watchdog does).
    """
    # Before the engine starts, so that its process inherits the limit too.
    set_ulimit()
    # Bound before the engine starts too, as vLLM's setup_server does: a port
    # chosen as free is taken now, not after a start-up of a minute in which
    # any outgoing connection of this machine may be given it.
    with create_server_socket((args.host, args.port)) as sock:
        vllm_config = EngineArgs.from_cli_args(args).create_engine_config()
        spec = vllm_config.speculative_config
        stat_logger = PrometheusStatLogger(
            model_name=served_names(args)[0],
            num_speculative_tokens=(spec.num_speculative_tokens or 0) if spec else 0,
            max_model_len=vllm_config.model_config.get_max_model_len(),
        )
        engine_client = AsyncLLM(vllm_config, stat_loggers=[stat_logger])
        try:
            app = build_app(args)
            app.state.stat_logger = stat_logger
            init_app_state(engine_client, app.state, args)
            await serve_http(
                app,
                engine_client,
                sock=sock,
                log_level=args.uvicorn_log_level,
                timeout_keep_alive=envs.TRACEVLLM_HTTP_TIMEOUT_KEEP_ALIVE,
                timeout_graceful_shutdown=5,
                limit_concurrency=args.limit_concurrency,
                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                request_read_timeout=args.request_read_timeout,
                **uvicorn_kwargs,
            )
            return 1 if engine_client.errored else 0
        finally:
            engine_client.shutdown()


# --8<-- [end:run_server]


class BindError(OSError):
    """The server's address cannot be bound (in use, not this machine's, or
    a port below 1024): ``tracevllm serve`` says so and exits 2."""


def create_server_socket(addr: tuple[str, int]) -> socket.socket:
    """A TCP socket bound to ``addr`` (vLLM's name): the first address the
    host resolves to ("" is every IPv4 interface, as in vLLM; "::1" or
    "[::1]" IPv6). SO_REUSEADDR lets a restarted server take its port while
    the last one's connections are in TIME_WAIT; vLLM sets SO_REUSEPORT too,
    which would let two servers share one port without an error, so it is
    left out here. A forked child (the engine, with
    TRACEVLLM_WORKER_MULTIPROC_METHOD=fork) closes its copy, so the port
    does not outlive this process there."""
    host, port = addr
    bare = host.strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            bare or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise BindError(e.errno, f"cannot resolve --host {host!r} ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = "pick another with --port" if e.errno == errno.EADDRINUSE else "check --host"
        raise BindError(e.errno, f"cannot bind {host}:{port} ({e.strerror}): {hint}") from None
    os.register_at_fork(after_in_child=sock.close)
    return sock
