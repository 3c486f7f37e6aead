"""OpenTelemetry for tracevllm: one TracerProvider per process, spans named
after the ``Class.method`` that emits them.

Mirrors vllm/tracing/ (``init_tracer``, ``instrument``, ``extract_trace_context``,
``SpanAttributes``). Differences: vLLM only sends to an OTLP endpoint;
tracevllm also writes OTLP JSON lines to a file, and has detail levels
("off", "request", "full"). With tracing off, ``get_tracer()`` is OTel's no-op
tracer and the ``instrument`` decorator is a plain function call.

Each process calls ``init_tracer`` once, *in* that process (the SDK's batch
processor thread does not survive fork), and ``shutdown_tracer`` on its way
out so that buffered spans reach the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import os
import random
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tracevllm.config import ObservabilityConfig, TraceConfig
from tracevllm.logger import init_logger
from tracevllm.tracing.attributes import SpanAttributes

logger = init_logger(__name__)

SPANS_FILE = "spans.jsonl"
_propagator = TraceContextTextMapPropagator()
_NOOP_TRACER = trace.NoOpTracer()


# Trace and span ids come from a generator of tracevllm's own, seeded by the
# OS, and seeded again in a forked child so that it does not mint its
# parent's ids. Not Python's global ``random``, as OTel's default generator:
# the engine seeds it (as vLLM's workers do) so that sampling is
# reproducible, and two processes seeded alike would mint the same ids. Nor
# the OS for every id (``secrets``): a system call each, 1.3 µs against 0.26.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


class _IdGenerator(IdGenerator):
    def generate_span_id(self) -> int:
        span_id = trace.INVALID_SPAN_ID
        while span_id == trace.INVALID_SPAN_ID:
            span_id = _ids.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = trace.INVALID_TRACE_ID
        while trace_id == trace.INVALID_TRACE_ID:
            trace_id = _ids.getrandbits(128)
        return trace_id


class _State:
    """This process's tracing state (one provider per process)."""

    provider: TracerProvider | None = None
    tracer: Tracer = _NOOP_TRACER
    detail: str = "off"


_state = _State()


def _not_compiling() -> bool:
    return False


# torch.compiler.is_dynamo_compiling once tracevllm.compilation is imported (tracing
# never imports torch itself). Dynamo reads it as True while it captures a
# model: the span helpers then do nothing, and cause no graph break. So a
# compiled forward has no per-layer spans (the layers run inside compiled
# pieces); the attention ops' spans remain, as the ops run as Python
# between the pieces.
is_compiling: Callable[[], bool] = _not_compiling


def set_is_compiling(func: Callable[[], bool]) -> None:
    global is_compiling
    is_compiling = func


F = TypeVar("F", bound=Callable[..., Any])


# --8<-- [start:init_tracer]
def init_tracer(
    process_kind: str,
    trace_config: TraceConfig,
    observability_config: ObservabilityConfig | None = None,
    span_processors: Sequence[SpanProcessor] = (),
    resource_attributes: Mapping[str, Any] | None = None,
) -> TracerProvider | None:
    """Make this process's TracerProvider (None when tracing is off).

    ``resource_attributes`` are added to its resource (a worker's ranks).
    """
    shutdown_tracer()
    endpoint = observability_config.otlp_traces_endpoint if observability_config else None
    if not trace_config.enabled and not endpoint:
        return None
    resource = Resource.create(
        {
            "service.name": "tracevllm",
            "process.pid": os.getpid(),
            SpanAttributes.PROCESS_KIND: process_kind,
            **(resource_attributes or {}),
        }
    )
    provider = TracerProvider(resource=resource, id_generator=_IdGenerator())
    if trace_config.out_dir:
        from tracevllm.tracing.exporters import OTLPJsonFileExporter

        os.makedirs(trace_config.out_dir, exist_ok=True)
        path = os.path.join(trace_config.out_dir, SPANS_FILE)
        # Both processes append to the same file; each line is one whole batch.
        provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(path)))
    if endpoint:
        from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    if trace_config.live_views:
        # Lazy: only `tracevllm trace` draws live; the engine never imports views.
        from tracevllm.views.report import RichViewProcessor

        provider.add_span_processor(RichViewProcessor())
    for processor in span_processors:
        provider.add_span_processor(processor)
    _state.provider = provider
    _state.tracer = provider.get_tracer("tracevllm")
    _state.detail = trace_config.detail if trace_config.enabled else "request"
    return provider


# --8<-- [end:init_tracer]


def shutdown_tracer() -> None:
    """Flush and close this process's provider (safe to call twice)."""
    if _state.provider is not None:
        _state.provider.shutdown()
    _state.provider = None
    _state.tracer = _NOOP_TRACER
    _state.detail = "off"


def flush_tracer(timeout_s: float = 2.0) -> None:
    """Write out the spans ended so far, waiting ``timeout_s`` at most.

    A child process calls it as it starts to stop, before the parts of its
    shutdown that may take long (stopping its own children): its parent
    kills it if it takes too long, and the spans still in the batch
    processor's buffer (up to 5 s of them) would go with it. The wait is
    bounded here, in a thread of its own: OTel's ``BatchSpanProcessor``
    takes ``force_flush``'s timeout but does not keep to it, and an OTLP
    exporter whose collector is gone retries for about 10 s a batch. The
    file's export takes milliseconds; an export still running after the
    wait finishes in ``shutdown_tracer``, as it did before this call.
    """
    provider = _state.provider
    if provider is None:
        return
    flush = threading.Thread(target=provider.force_flush, name="tracevllm-flush", daemon=True)
    flush.start()
    flush.join(timeout_s)


def get_tracer() -> Tracer:
    return _state.tracer


def get_provider() -> TracerProvider | None:
    return _state.provider


def is_enabled() -> bool:
    return _state.provider is not None


# Set inside untraced(): instrumented methods make no span there.
_untraced: contextvars.ContextVar[bool] = contextvars.ContextVar("untraced", default=False)
# untraced()'s parent, the same in every process ("tracevllm-untrac" as its
# trace id), so that a worker process can tell it from a request's trace that
# a sampler dropped, and its cache of parsed trace contexts (_extract) holds
# one entry for every poll.
_UNTRACED_TRACE_ID = int.from_bytes(b"tracevllm-untrac", "big")
_UNSAMPLED = trace.set_span_in_context(
    trace.NonRecordingSpan(
        trace.SpanContext(
            trace_id=_UNTRACED_TRACE_ID,
            span_id=int.from_bytes(b"untraced", "big"),
            is_remote=False,
            trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT),
        )
    )
)


def own_trace_if_untraced() -> Context | None:
    """The parent of a span that belongs to no request's trace: the current
    span (None), or inside untraced(), here or in the process it called, a
    trace of its own (an empty Context), so that the span still records."""
    if (
        _untraced.get()
        or trace.get_current_span().get_span_context().trace_id == _UNTRACED_TRACE_ID
    ):
        return Context()
    return None


@contextlib.contextmanager
def untraced() -> Any:
    """No span in this block, in this process or in the processes it calls.

    Instrumented methods skip their span (as with tracing off), and the
    current span is a valid one that is not sampled: a span started under it
    by the SDK does not record (the default ``ParentBased`` sampler), and the
    ``traceparent`` it injects (flags ``00``) tells a worker process the same.
    A span with an explicit parent (a request's, from its trace headers)
    still records; one that would fall back to the current span (a request
    without trace headers) takes ``own_trace_if_untraced()``. With a sampler
    that ignores the parent (``OTEL_TRACES_SAMPLER=always_on``) a worker's
    spans still record, under a parent that is not exported. For the
    engine's polls of pending KV transfers (``EngineCore.step_fn``), which
    schedule nothing and would otherwise write a step span every 10 ms.
    """
    token = otel_context.attach(_UNSAMPLED)
    flag = _untraced.set(True)
    try:
        yield
    finally:
        _untraced.reset(flag)
        otel_context.detach(token)


def is_full_detail() -> bool:
    return _state.detail == "full" and not is_compiling()


def code_attributes(func: Callable[..., Any]) -> dict[str, Any]:
    """``code.*`` attributes pointing at a function's source."""
    func = inspect.unwrap(func)
    code = func.__code__
    return {
        SpanAttributes.CODE_FUNCTION_NAME: func.__qualname__,
        SpanAttributes.CODE_FILE_PATH: _relative_path(code.co_filename),
        SpanAttributes.CODE_LINE_NUMBER: code.co_firstlineno,
    }


def _relative_path(path: str) -> str:
    # Relative to the repository (tracevllm/...), so traces are portable.
    for root in ("tracevllm", "kernels"):
        marker = os.sep + root + os.sep
        if marker in path:
            return root + os.sep + path.rsplit(marker, 1)[1]
    return path


# The parent and record functions that have raised, each logged once only:
# one that fails fails at every step.
_failed: set[Callable[..., Any]] = set()


def _tracing_failed(func: Callable[..., Any], span_name: str, error: Exception) -> None:
    if func in _failed:
        return
    _failed.add(func)
    logger.warning(
        "Tracing: %s of span %s raised %s: %s; the span is kept without it, and further "
        "errors of %s are not logged.",
        func.__qualname__,
        span_name,
        type(error).__name__,
        error,
        func.__qualname__,
        exc_info=error,
    )


def _parent_context(
    parent: Callable[..., Context | None] | None,
    span_name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Context | None:
    """``parent(*args, **kwargs)``, or None (the current span) if there is
    none or it raises: a span with the wrong parent beats a dead engine."""
    if parent is None:
        return None
    try:
        return parent(*args, **kwargs)
    except Exception as e:
        _tracing_failed(parent, span_name, e)
        return None


class _Recorded:
    """What a ``record`` function puts on a span, held until it has returned."""

    __slots__ = ("attributes", "links")

    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}
        self.links: list[tuple[trace.SpanContext, Mapping[str, Any] | None]] = []

    def is_recording(self) -> bool:
        return True

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def add_link(
        self, context: trace.SpanContext, attributes: Mapping[str, Any] | None = None
    ) -> None:
        self.links.append((context, attributes))

    def apply(self, span: Span) -> None:
        if self.attributes:
            span.set_attributes(self.attributes)
        for context, attributes in self.links:
            span.add_link(context, attributes)


# --8<-- [start:instrument]
def instrument(
    span_name: str | None = None,
    *,
    parent: Callable[..., Context | None] | None = None,
    record: Callable[..., None] | None = None,
) -> Callable[[F], F]:
    """Wrap a method in a span named ``Class.method`` with its code location.

    ``parent(*args)`` picks the span's parent context (default: the current
    span); ``record(span, result, *args)`` puts what the method did on the
    span once it returns, only when the span records. So the engine's
    methods hold no tracing code: what a span shows is written in
    tracing/records.py. With tracing off, the wrapper costs one attribute
    check per call.

    Tracing never takes the engine down: a ``parent`` or ``record`` that
    raises is logged once (``_tracing_failed``) and the span goes on without
    it (the current span as parent; none of the record's attributes). The
    method's own exceptions pass through untouched.
    """

    def decorator(func: F) -> F:
        name = span_name or func.__qualname__
        attributes = code_attributes(func)

        def start(*args: Any, **kwargs: Any) -> Any:
            context = _parent_context(parent, name, args, kwargs)
            return _state.tracer.start_as_current_span(name, context=context, attributes=attributes)

        def finish(span: Span, result: Any, *args: Any, **kwargs: Any) -> None:
            if record is not None and span.is_recording():
                # Into a buffer first, so that a record that raises halfway
                # leaves none of its attributes (nor links) on the span.
                recorded = _Recorded()
                try:
                    record(recorded, result, *args, **kwargs)
                except Exception as e:
                    _tracing_failed(record, name, e)
                    span.set_attribute(SpanAttributes.RECORD_ERROR, f"{type(e).__name__}: {e}")
                    return
                recorded.apply(span)

        if inspect.isasyncgenfunction(func):
            return _instrument_async_generator(func, name, attributes, parent)  # type: ignore[return-value]

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                if _state.provider is None or _untraced.get():
                    return await func(*args, **kwargs)
                with start(*args, **kwargs) as span:
                    result = await func(*args, **kwargs)
                    finish(span, result, *args, **kwargs)
                    return result

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _state.provider is None or is_compiling() or _untraced.get():
                return func(*args, **kwargs)
            with start(*args, **kwargs) as span:
                result = func(*args, **kwargs)
                finish(span, result, *args, **kwargs)
                return result

        return wrapper  # type: ignore[return-value]

    return decorator


def _instrument_async_generator(
    func: Callable[..., Any],
    name: str,
    attributes: dict[str, Any],
    parent: Callable[..., Context | None] | None,
) -> Callable[..., Any]:
    """An async generator's span lasts from its first step to its last.

    Its context is current only while the generator's own code runs (between
    two yields), never in the code that iterates it.
    """

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _state.provider is None:
            # Closed on the way out, so the generator's own cleanup (an abort)
            # runs now, as with tracing on, not whenever it is collected.
            async with contextlib.aclosing(func(*args, **kwargs)) as agen:
                async for item in agen:
                    yield item
            return
        context = _parent_context(parent, name, args, kwargs)
        span = _state.tracer.start_span(name, context=context, attributes=attributes)
        span_context = trace.set_span_in_context(span, context)
        agen = func(*args, **kwargs)
        try:
            while True:
                token = otel_context.attach(span_context)
                try:
                    item = await agen.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    otel_context.detach(token)
                yield item
        except BaseException as e:
            # A reader that stops early (a client hung up) is no error.
            if not isinstance(e, (GeneratorExit, asyncio.CancelledError)):
                span.record_exception(e)
                span.set_status(trace.StatusCode.ERROR, str(e))
            raise
        finally:
            token = otel_context.attach(span_context)
            try:
                await agen.aclose()
            finally:
                otel_context.detach(token)
                span.end()

    return wrapper


# --8<-- [end:instrument]


# --8<-- [start:forward_spans]
class _ForwardSpans:
    """The spans of one model forward: timed while it runs, made once it ends.

    A span made between two kernels costs more than twice what the same span
    costs in a loop: the matmuls in between have pushed OTel's code and data
    out of the CPU's caches. So inside the forward a span is only a
    ``_TimedSpan`` (name, attributes, parent and two ``time.time_ns()``
    stamps, OTel's own clock), and ``end`` makes the OTel spans in one go,
    with those times. The spans are the same; only the work moves.
    """

    __slots__ = ("timed", "open", "ended")

    def __init__(self) -> None:
        self.timed: list[_TimedSpan] = []  # in the order they started
        self.open: list[_TimedSpan] = []  # the current one last
        self.ended: list[_TimedSpan] = []  # in the order they ended

    def end(self, tracer: Tracer) -> None:
        """Make the spans; the outermost ones are children of the current span."""
        made: dict[_TimedSpan, Span] = {}
        for t in self.timed:  # a parent before its children
            context = None if t.parent is None else trace.set_span_in_context(made[t.parent])
            span = tracer.start_span(t.name, context, attributes=t.attributes, start_time=t.start)
            if t.error is not None:  # what start_as_current_span records
                stacktrace = {"exception.stacktrace": t.stacktrace}
                span.record_exception(t.error, stacktrace, timestamp=t.end)
                span.set_status(Status(StatusCode.ERROR, f"{type(t.error).__name__}: {t.error}"))
            made[t] = span
        for t in self.ended:
            made[t].end(end_time=t.end)


class _TimedSpan:
    """One span inside a forward, as a record. Entered, it is the current one
    (``current_span``), and takes ``set_attribute`` as a span does."""

    __slots__ = ("forward", "name", "attributes", "parent", "start", "end", "error", "stacktrace")

    def __init__(self, forward: _ForwardSpans, name: str, attributes: Mapping[str, Any]) -> None:
        self.forward, self.name, self.attributes = forward, name, attributes
        self.parent: _TimedSpan | None = None
        self.start = self.end = 0
        self.error: Exception | None = None
        self.stacktrace = ""

    def __enter__(self) -> _TimedSpan:
        open_ = self.forward.open
        self.parent = open_[-1] if open_ else None
        self.forward.timed.append(self)
        open_.append(self)
        self.start = time.time_ns()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.end = time.time_ns()
        self.forward.open.pop()
        self.forward.ended.append(self)
        # As OTel's use_span: an Exception is an error, a KeyboardInterrupt or
        # SystemExit (Ctrl-C, SIGTERM) is not. The traceback is taken here,
        # where it leaves the span, not where the forward ends.
        if isinstance(exc, Exception):
            self.error = exc
            self.stacktrace = "".join(traceback.format_exception(exc))

    def is_recording(self) -> bool:
        return True

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes = {**self.attributes, key: value}  # the caller's dict stays as it was


# The forward running in this thread (or task), if its spans are being timed.
_forward: contextvars.ContextVar[_ForwardSpans | None] = contextvars.ContextVar(
    "tracevllm_forward", default=None
)


@contextlib.contextmanager
def forward_spans() -> Any:
    """Around a model's forward: ``span()`` inside it only times (see
    _ForwardSpans). A forward inside another one joins the outer's records.
    OTel spans made inside a forward (an ``instrument``-ed method) are
    children of the span current outside it: the timed ones are not OTel's."""
    if _state.provider is None or is_compiling() or _forward.get() is not None:
        yield
        return
    forward = _ForwardSpans()
    token = _forward.set(forward)
    try:
        yield
    finally:
        _forward.reset(token)
        forward.end(_state.tracer)


def span(name: str, attributes: Mapping[str, Any]) -> Any:
    """A span around a block: timed now and made at the end of the forward
    when inside ``forward_spans``, else an OTel span made now."""
    if is_compiling():
        return contextlib.nullcontext()
    forward = _forward.get()
    if forward is not None:
        return _TimedSpan(forward, name, attributes)
    return _state.tracer.start_as_current_span(name, attributes=attributes)


# --8<-- [end:forward_spans]


def current_span() -> Span | _TimedSpan:
    """The span open now: inside a forward, the timed one (forward_spans);
    else OTel's current span (a non-recording one when tracing is off)."""
    forward = _forward.get()
    if forward is not None and forward.open:
        return forward.open[-1]
    return trace.get_current_span()


def inject_trace_context(context: Context | None = None) -> dict[str, str]:
    """W3C ``traceparent`` (and ``tracestate``) of a context, for the wire."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    return carrier


# The W3C headers that carry a trace across processes (vLLM's TRACE_HEADERS).
TRACE_HEADERS = ("traceparent", "tracestate")


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The trace headers of an HTTP request (vllm/tracing/utils.py)."""
    return {h: headers[h] for h in TRACE_HEADERS if h in headers}


def extract_trace_context(headers: Mapping[str, str] | None) -> Context | None:
    """The context a request's trace headers carry (None without headers).

    A request's headers are read at each step that serves it (the step span
    links to it): they are parsed once, and the (immutable) Context shared.
    Only headers of a valid size are kept (a client sends them).
    """
    if not headers:
        return None
    traceparent, tracestate = headers.get("traceparent"), headers.get("tracestate")
    if (
        isinstance(traceparent, str)
        and len(traceparent) <= _MAX_KEPT
        and (tracestate is None or (isinstance(tracestate, str) and len(tracestate) <= _MAX_KEPT))
    ):
        return _extract(traceparent, tracestate)
    return _propagator.extract(dict(headers))


@contextlib.contextmanager
def trace_context(headers: Mapping[str, str] | None) -> Any:
    """Make the context ``headers`` carry the current one in this block, so the
    spans made in it join a trace from another process (a worker's, the step's)."""
    context = extract_trace_context(headers)
    if context is None:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


# OTel ignores a longer traceparent; W3C asks that a tracestate be kept to
# 512 characters. So the cache holds at most 4096 x 1 KiB.
_MAX_KEPT = 512


@functools.lru_cache(maxsize=4096)
def _extract(traceparent: str, tracestate: str | None) -> Context:
    carrier = {"traceparent": traceparent}
    if tracestate is not None:
        carrier["tracestate"] = tracestate
    return _propagator.extract(carrier)
