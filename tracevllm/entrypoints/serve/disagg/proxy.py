"""The disaggregation proxy: ``tracevllm disagg-proxy --prefill URL --decode URL``.

tracevllm's own, after vLLM's proxy examples (not in the wheel):
``examples/online_serving/disaggregated_serving/disagg_proxy_demo.py`` (the
``Proxy`` class, its round-robin ``schedule`` over the instances, its 502
for a backend that does not answer) and
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` (what it sends
the prefill server). Each POST /v1/completions and /v1/chat/completions goes
first to a prefill server (``kv_role="kv_producer"``) with ``max_tokens=1``
(and ``max_completion_tokens=1``), ``stream=False`` and ``kv_transfer_params``
``{"do_remote_decode": true, ...}``; the ``kv_transfer_params`` of its answer
then go, with the client's request unchanged otherwise, to a decode server
(``kv_consumer``), whose answer, whole or streamed, is the client's. Nothing
here knows the connector: what the producer returns is passed on as it is.

Several prefill and decode servers take turns (round-robin, each list on its
own). A backend that does not answer is a 502, a backend's own error (a 4xx,
a 5xx) comes back with its status and its OpenAI error object, and a client
that hangs up, before the answer or in the middle of a stream, closes the
connection to the backend, which aborts the request there. GET /v1/models
asks a decode server; GET /health is 200 only while every backend's is.

Traced (``--trace-detail request``): the proxy is a process of its own in the
trace (``tracevllm.process_kind="proxy"``), with a span per request
(``DisaggProxy.create_completion`` / ``create_chat_completion``, the child of
the client's ``traceparent``) and under it one for each backend call
(``DisaggProxy.prefill``, ``DisaggProxy.decode``), whose context goes to that
backend in the W3C ``traceparent`` header. The prefill server's answer carries
its own trace context in ``kv_transfer_params``, so the decode server's
request continues the prefill server's (tracevllm/tracing/kv_transfer.py).

Left out: the demo's ``/instances/add`` and its load-aware scheduling
policies, retrying a request on another backend, an API key of its own
(the client's ``Authorization`` header goes to the backends).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from http import HTTPStatus
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode
from starlette.types import Receive, Scope, Send

from tracevllm import tracing
from tracevllm.entrypoints.openai.engine.protocol import ErrorInfo, ErrorResponse
from tracevllm.logger import init_logger

logger = init_logger(__name__)

# What the prefill server is told (vLLM's toy proxy sends the same): compute
# the prompt, keep its KV for a decode server to take, answer one token.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# A prefill server is not asked for these (vLLM's toy proxy drops them too).
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
# The client's headers that go on to the backends.
_FORWARDED_HEADERS = ("authorization",)


def error_response(status: int, message: str) -> JSONResponse:
    """OpenAI's error object, as ``tracevllm serve`` answers (404 -> NotFoundError)."""
    err_type = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    err = ErrorResponse(error=ErrorInfo(message=message, type=err_type, code=status))
    return JSONResponse(err.model_dump(), status_code=status)


class BackendError(Exception):
    """A backend that did not answer, or answered with an error: the client's answer."""

    def __init__(self, response: Response) -> None:
        super().__init__(bytes(response.body).decode(errors="replace"))
        self.response = response


async def _backend_error(url: str, response: httpx.Response) -> BackendError:
    """A backend's error status: its own OpenAI error object if it sent one."""
    body = await response.aread()
    try:
        content = json.loads(body)
    except ValueError:
        content = None
    if isinstance(content, dict) and isinstance(content.get("error"), dict):
        return BackendError(JSONResponse(content, status_code=response.status_code))
    text = body.decode(errors="replace").strip() or HTTPStatus(response.status_code).phrase
    return BackendError(error_response(response.status_code, f"{url} answered: {text}"))


def _unreachable(url: str, e: httpx.HTTPError) -> BackendError:
    message = f"Bad Gateway: no answer from {url} ({type(e).__name__}: {e})."
    return BackendError(error_response(HTTPStatus.BAD_GATEWAY, message))


class _RelayResponse(StreamingResponse):
    """The decode server's open response, relayed chunk by chunk. However the
    relay ends (done, the backend breaking off, the client hanging up, which
    cancels it) the backend's connection is closed (a backend that loses its
    client aborts the request) and the spans end, marked failed if it failed."""

    def __init__(self, upstream: httpx.Response, spans: tuple[Span, ...]) -> None:
        media_type = upstream.headers.get("content-type", "text/event-stream")
        super().__init__(iter(()), status_code=upstream.status_code, media_type=media_type)
        self.upstream = upstream
        self.spans = spans
        self.error: BaseException | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BaseException as e:
            self.error = self.error or e
            raise
        finally:
            await _close(self.upstream, self.spans, self.error)

    async def stream_response(self, send: Send) -> None:
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code,
                 "headers": self.raw_headers}
            )  # fmt: skip
            try:
                async for chunk in self.upstream.aiter_raw():
                    await send(_body(chunk))
            except httpx.HTTPError as e:
                # As the server itself reports an error mid-stream: an error event.
                self.error = e
                info = ErrorInfo(
                    message=f"The decode server broke off the stream ({type(e).__name__}: {e}).",
                    type="BadGatewayError",
                    code=HTTPStatus.BAD_GATEWAY,
                )
                event = f"data: {json.dumps(ErrorResponse(error=info).model_dump())}\n\n"
                await send(_body(event.encode() + b"data: [DONE]\n\n"))
            await send(_body(b"", more_body=False))
        except BaseException as e:
            self.error = self.error or e
            raise


def _body(chunk: bytes, more_body: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": more_body}


async def _close(
    upstream: httpx.Response, spans: tuple[Span, ...], error: BaseException | None
) -> None:
    """Close a backend's response (even in a cancelled task) and end the spans."""
    with anyio.CancelScope(shield=True):
        await upstream.aclose()
    for span in spans:
        if span.is_recording():
            _end(span, error)


class DisaggProxy:
    """Prefill servers and decode servers behind one OpenAI endpoint."""

    def __init__(self, prefill_instances: list[str], decode_instances: list[str]) -> None:
        if not prefill_instances or not decode_instances:
            raise ValueError("The proxy needs at least one --prefill and one --decode server.")
        self.prefill_instances = [url.rstrip("/") for url in prefill_instances]
        self.decode_instances = [url.rstrip("/") for url in decode_instances]
        self.prefill_cycler = itertools.cycle(self.prefill_instances)
        self.decode_cycler = itertools.cycle(self.decode_instances)
        self.client: httpx.AsyncClient | None = None

    def schedule(self, cycler: Iterator[str]) -> str:
        """The next instance, round-robin (the demo's ``RoundRobinSchedulingPolicy``)."""
        return next(cycler)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        # No timeout: a long prompt's prefill, a long stream's decode.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(timeout=None, limits=limits)
        try:
            yield
        finally:
            await self.client.aclose()

    # --------------------------------------------------------------- requests
    async def create_completion(self, raw_request: Request) -> Response:
        return await self._forward(raw_request, "/v1/completions", "create_completion")

    async def create_chat_completion(self, raw_request: Request) -> Response:
        return await self._forward(raw_request, "/v1/chat/completions", "create_chat_completion")

    async def _forward(self, raw_request: Request, endpoint: str, method: str) -> Response:
        try:
            request = await raw_request.json()
        except ValueError as e:
            return error_response(400, f"The request body is not valid JSON: {e}")
        if not isinstance(request, dict):
            return error_response(400, "The request body must be a JSON object.")
        stream = bool(request.get("stream"))
        request_id = raw_request.headers.get("x-request-id") or f"disagg-{uuid.uuid4().hex}"
        headers = {**_forwarded(raw_request), "X-Request-Id": request_id}
        parent = tracing.extract_trace_context(tracing.extract_trace_headers(raw_request.headers))
        span = tracing.get_tracer().start_span(
            f"DisaggProxy.{method}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "url.path": endpoint,
                "gen_ai.request.id": request_id,
                "tracevllm.disagg.stream": stream,
            },
        )
        try:
            with trace.use_span(span, end_on_exit=False):
                kv_transfer_params = await self.prefill(endpoint, request, headers)
                decode_request = dict(request)
                # Only the prefill server's params go on: a client's own would
                # name blocks and hosts for the decode server to read.
                decode_request.pop("kv_transfer_params", None)
                if kv_transfer_params:
                    decode_request["kv_transfer_params"] = kv_transfer_params
                decode_span, response = await self.decode(endpoint, decode_request, headers)
        except BackendError as e:
            span.set_status(StatusCode.ERROR, str(e))
            span.set_attribute("http.response.status_code", e.response.status_code)
            span.end()
            return e.response
        except BaseException as e:  # a client that hung up (cancelled), a bug
            span.set_status(StatusCode.ERROR, f"{type(e).__name__}: {e}")
            span.end()
            raise
        span.set_attribute("http.response.status_code", response.status_code)
        if stream:
            return _RelayResponse(response, (decode_span, span))
        error: BaseException | None = None
        try:
            body = await response.aread()
        except httpx.HTTPError as e:
            error = _unreachable(str(response.url), e)
            return error.response
        except BaseException as e:  # the client hung up: cancelled
            error = e
            raise
        finally:
            await _close(response, (decode_span, span), error)
        media_type = response.headers.get("content-type", "application/json")
        return Response(body, status_code=response.status_code, media_type=media_type)

    async def prefill(
        self, endpoint: str, request: dict[str, Any], headers: Mapping[str, str]
    ) -> dict[str, Any] | None:
        """Compute the prompt on the next prefill server; its ``kv_transfer_params``."""
        url = self.schedule(self.prefill_cycler)
        prefill_request = {k: v for k, v in request.items() if k not in _NOT_FOR_PREFILL}
        prefill_request |= {
            "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS),
            "stream": False,
            "max_tokens": 1,
        }
        if "max_completion_tokens" in request:
            prefill_request["max_completion_tokens"] = 1
        assert self.client is not None
        with _backend_span("prefill", url, endpoint) as (span, trace_headers):
            try:
                response = await self.client.post(
                    url + endpoint, json=prefill_request, headers={**headers, **trace_headers}
                )
            except httpx.HTTPError as e:
                raise _unreachable(url, e) from e
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 400:
                raise await _backend_error(url, response)
            try:
                answer = response.json()
            except ValueError as e:
                raise BackendError(
                    error_response(HTTPStatus.BAD_GATEWAY, f"{url} answered with no JSON: {e}")
                ) from e
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            # The keys only: the values are the connector's, and may be long.
            span.set_attribute("tracevllm.disagg.kv_transfer_params", sorted(params or ()))
            return params if isinstance(params, dict) else None

    async def decode(
        self, endpoint: str, request: dict[str, Any], headers: Mapping[str, str]
    ) -> tuple[Span, httpx.Response]:
        """Send the request to the next decode server; its open response and
        the span that ends with it (the caller reads the body)."""
        url = self.schedule(self.decode_cycler)
        assert self.client is not None
        with _backend_span("decode", url, endpoint, end=False) as (span, trace_headers):
            try:
                response = await self.client.send(
                    self.client.build_request(
                        "POST", url + endpoint, json=request, headers={**headers, **trace_headers}
                    ),
                    stream=True,
                )
            except httpx.HTTPError as e:
                raise _unreachable(url, e) from e
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 400:
                try:
                    raise await _backend_error(url, response)
                finally:
                    await response.aclose()
            return span, response

    # ------------------------------------------------------------ passthrough
    async def show_available_models(self, raw_request: Request) -> Response:
        url = self.schedule(self.decode_cycler)
        assert self.client is not None
        try:
            response = await self.client.get(url + "/v1/models", headers=_forwarded(raw_request))
        except httpx.HTTPError as e:
            return _unreachable(url, e).response
        return Response(
            response.content,
            status_code=response.status_code,
            media_type=response.headers.get("content-type"),
        )

    async def health(self) -> Response:
        """200 while every backend answers its /health with 200; else 503."""
        assert self.client is not None
        client = self.client

        async def check(url: str) -> str | None:
            try:
                response = await client.get(url + "/health", timeout=10)
            except httpx.HTTPError as e:
                return f"{url}: {type(e).__name__}"
            return None if response.status_code == 200 else f"{url}: {response.status_code}"

        urls = [*self.prefill_instances, *self.decode_instances]
        failed = [f for f in await asyncio.gather(*map(check, urls)) if f is not None]
        if failed:
            message = "Backends not healthy: " + ", ".join(failed)
            return error_response(HTTPStatus.SERVICE_UNAVAILABLE, message)
        return Response(status_code=HTTPStatus.OK)


def _forwarded(raw_request: Request) -> dict[str, str]:
    return {h: v for h in _FORWARDED_HEADERS if (v := raw_request.headers.get(h))}


@contextlib.contextmanager
def _backend_span(
    role: str, url: str, endpoint: str, end: bool = True
) -> Iterator[tuple[Span, dict[str, str]]]:
    """A CLIENT span for one backend call, current inside, with the headers
    that carry it; ended on the way out (with ``end=False`` only if the block
    raises), marked failed by an error."""
    span = tracing.get_tracer().start_span(
        f"DisaggProxy.{role}",
        kind=SpanKind.CLIENT,
        attributes={"server.address": url, "url.path": endpoint, "tracevllm.disagg.role": role},
    )
    try:
        with trace.use_span(
            span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        ):
            yield span, tracing.inject_trace_context()
    except BaseException as e:
        _end(span, e)
        raise
    if end:
        _end(span)


def _end(span: Span, error: BaseException | None = None) -> None:
    if isinstance(error, BackendError):
        span.set_attribute("http.response.status_code", error.response.status_code)
    if isinstance(error, asyncio.CancelledError):
        span.set_status(StatusCode.ERROR, "the client hung up")
    elif error is not None:
        span.set_status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:500])
    span.end()


def build_app(proxy: DisaggProxy) -> FastAPI:
    """The proxy's routes (vLLM's demo: ``Proxy.setup_routes``); a client that
    hangs up before its answer cancels the handler (``with_cancellation``)."""
    from tracevllm.entrypoints.openai.api_server import with_cancellation

    app = FastAPI(lifespan=proxy.lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    post = functools.partial(app.add_api_route, methods=["POST"])
    post("/v1/completions", with_cancellation(proxy.create_completion))
    post("/v1/chat/completions", with_cancellation(proxy.create_chat_completion))
    app.add_api_route("/v1/models", proxy.show_available_models, methods=["GET"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    return app


def instance_url(instance: str) -> str:
    """``host:port`` or a URL -> the server's base URL."""
    url = instance if "://" in instance else f"http://{instance}"
    return url.rstrip("/").removesuffix("/v1")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill server (kv_producer): http://host:port or host:port; "
                        "again for more (round-robin)")  # fmt: skip
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode server (kv_consumer); again for more")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--trace-detail", choices=("off", "request"), default="off",
                        help="trace each request (its span and the backend calls')")  # fmt: skip
    parser.add_argument("--trace-dir", default=None, help="append the spans to DIR/spans.jsonl")
    parser.add_argument("--otlp-traces-endpoint", default=None, help="send the spans there too")
    levels = ("critical", "error", "warning", "info", "debug", "trace")
    parser.add_argument("--uvicorn-log-level", default="info", choices=levels)


def run_disagg_proxy(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM (uvicorn drains, then the spans are flushed)."""
    import uvicorn

    from tracevllm.config import ObservabilityConfig, TraceConfig

    proxy = DisaggProxy(
        [instance_url(u) for u in args.prefill], [instance_url(u) for u in args.decode]
    )
    tracing.init_tracer(
        "proxy",
        TraceConfig(detail=args.trace_detail, out_dir=args.trace_dir),
        ObservabilityConfig(otlp_traces_endpoint=args.otlp_traces_endpoint),
    )
    try:
        config = uvicorn.Config(
            build_app(proxy), host=args.host, port=args.port, log_level=args.uvicorn_log_level
        )
        asyncio.run(uvicorn.Server(config).serve())
    finally:
        tracing.shutdown_tracer()
    return 0
