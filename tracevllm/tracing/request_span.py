"""The ``llm_request`` span: one per request, from arrival to its last token.

vLLM makes this span in ``OutputProcessor.do_tracing`` once the request has
finished (``instrument_manual(start_time=arrival)``). tracevllm starts it when
the request arrives instead, so that every span made about the request while
it runs, in either process, can be its child: its context is what
``trace_headers`` carry across the boundary. It is ended the same way, with
vLLM's attributes, when the request finishes (for ``n`` > 1: when the last
child does), or with status ERROR when it fails (``fail``: the engine died).
The engine files call ``llm_request_span`` around ``add_request``, and find
a request's span with ``find_request_span``: by the trace context the request
carries, which is the span's own, so no signature passes the span along.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from tracevllm.tracing import extract_trace_context, get_tracer, inject_trace_context, is_enabled
from tracevllm.tracing.attributes import SpanAttributes

if TYPE_CHECKING:
    from tracevllm.metrics.stats import RequestStateStats
    from tracevllm.outputs import CompletionOutput
    from tracevllm.sampling_params import SamplingParams


# This process's live llm_request spans, by span id (find_request_span).
_live_spans: dict[int, LLMRequestSpan] = {}


def find_request_span(trace_headers: Mapping[str, str] | None) -> LLMRequestSpan | None:
    """The live ``llm_request`` span of the request that carries these trace
    headers (None with tracing off, or once the span has ended)."""
    if not _live_spans:
        return None
    context = extract_trace_context(trace_headers)
    if context is None:
        return None
    return _live_spans.get(trace.get_current_span(context).get_span_context().span_id)


class LLMRequestSpan:
    """The live span of one request (shared by the ``n`` children of a parent)."""

    def __init__(self, span: trace.Span, request_id: str, n: int) -> None:
        self.span = span
        self.span_id = span.get_span_context().span_id
        self.request_id = request_id
        self.n = n
        # When each batch of tokens reached the frontend (inter-token latency).
        self.token_times: list[float] = []
        # Finished children's whole completions, until all n are in.
        self.completions: list[CompletionOutput] = []
        # The error already recorded on the span, if any.
        self.error: BaseException | None = None
        _live_spans[self.span_id] = self

    def record_error(self, error: BaseException) -> None:
        """Record the error on the span and set status ERROR (once per
        error); the span ends later (an abort that follows, or ``fail``)."""
        if error is self.error or not self.span.is_recording():
            return
        self.error = error
        self.span.record_exception(error)
        self.span.set_status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}")

    def fail(self, error: BaseException) -> None:
        """End the span now, with the error: adding the request failed, or
        the engine died under it."""
        self.record_error(error)
        self._end()

    def _end(self) -> None:
        if _live_spans.pop(self.span_id, None) is not None:  # ends once
            self.span.end()

    def finish_child(
        self,
        completion: CompletionOutput,
        params: SamplingParams,
        stats: RequestStateStats,
        num_prompt_tokens: int,
        num_cached_tokens: int,
    ) -> None:
        """Record one finished (or aborted) child; end the span after the last."""
        self.completions.append(completion)
        if len(self.completions) < self.n:
            return
        if not self.span.is_recording():
            self._end()
            return
        completions = sorted(self.completions, key=lambda c: c.index)
        now = time.time()
        times = self.token_times
        output_tokens = sum(len(c.token_ids) for c in completions)
        # vLLM's attributes, as its do_tracing sets them (the request's
        # parameters only when truthy). Core timestamps share one clock.
        attrs: dict[str, Any] = {
            SpanAttributes.GEN_AI_REQUEST_ID: self.request_id,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt_tokens,
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: output_tokens,
            SpanAttributes.GEN_AI_LATENCY_E2E: now - stats.arrival_time,
        }
        if stats.scheduled_ts:
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE] = (
                stats.scheduled_ts - stats.queued_ts
            )
        if stats.first_token_ts:
            attrs |= {
                SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: stats.first_token_latency,
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: (
                    stats.first_token_ts - stats.scheduled_ts
                ),
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: (
                    stats.last_token_ts - stats.first_token_ts
                ),
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: (
                    stats.last_token_ts - stats.scheduled_ts
                ),
            }
        for name, value in (
            (SpanAttributes.GEN_AI_REQUEST_TOP_P, params.top_p),
            (SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens),
            (SpanAttributes.GEN_AI_REQUEST_TEMPERATURE, params.temperature),
            (SpanAttributes.GEN_AI_REQUEST_N, self.n),
        ):
            if value:
                attrs[name] = value
        # The OTel GenAI conventions' names, which vLLM does not set.
        attrs |= {
            SpanAttributes.GEN_AI_REQUEST_TOP_K: params.top_k,
            SpanAttributes.GEN_AI_USAGE_INPUT_TOKENS: num_prompt_tokens,
            SpanAttributes.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
            SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS: [
                c.finish_reason or "abort" for c in completions
            ],
        }
        if params.seed is not None:
            attrs[SpanAttributes.GEN_AI_REQUEST_SEED] = params.seed
        if stats.num_drafts:
            # Speculative decoding: how many drafts this request's steps kept.
            attrs |= {
                SpanAttributes.SPEC_DECODE_NUM_DRAFTS: stats.num_drafts,
                SpanAttributes.SPEC_DECODE_NUM_DRAFT_TOKENS: stats.num_draft_tokens,
                SpanAttributes.SPEC_DECODE_NUM_ACCEPTED_TOKENS: stats.num_accepted_tokens,
                SpanAttributes.SPEC_DECODE_ACCEPTANCE_RATE: (
                    stats.num_accepted_tokens / stats.num_draft_tokens
                ),
            }
        # tracevllm's own, for the completion view.
        attrs |= {
            SpanAttributes.NUM_CACHED_TOKENS: num_cached_tokens,
            SpanAttributes.COMPLETION_TEXT: "\n---\n".join(c.text for c in completions),
            SpanAttributes.INTER_TOKEN_MS: [(b - a) * 1e3 for a, b in zip(times, times[1:])],
        }
        self.span.set_attributes(attrs)
        if any(c.finish_reason == "error" for c in completions):
            self.span.set_status(trace.StatusCode.ERROR, "the engine failed the request")
        self._end()


@contextlib.contextmanager
def llm_request_span(
    request_id: str,
    arrival_time: float,
    n: int,
    trace_headers: Mapping[str, str] | None,
    remote_trace_headers: Mapping[str, str] | None = None,
) -> Iterator[Mapping[str, str] | None]:
    """Start the request's span (tracing on) and make it current.

    Yields the trace headers to send with the request: the span's own
    context, so the engine core's spans about the request become its
    children, and ``find_request_span`` finds it. If adding the request
    fails, the span ends at once, with the error. ``remote_trace_headers``:
    the context of the same request on the engine that computed its prompt
    (a KV producer's, from ``kv_transfer_params``): the span continues that
    trace, and links to the code that added it here.
    """
    if not is_enabled():
        yield trace_headers
        return
    # The parent: the span of the code adding the request (LLM.generate,
    # AsyncLLM.generate), else the context the caller brought in
    # trace_headers (an HTTP traceparent given straight to add_request).
    current = trace.get_current_span()
    context = None if current.is_recording() else extract_trace_context(trace_headers)
    links = []
    if (remote := extract_trace_context(remote_trace_headers)) is not None:
        if current.is_recording():
            links.append(trace.Link(current.get_span_context()))
        context = remote
    span = get_tracer().start_span(
        "llm_request",
        context=context,
        links=links,
        kind=trace.SpanKind.SERVER,
        start_time=int(arrival_time * 1e9),
        attributes={SpanAttributes.GEN_AI_REQUEST_ID: request_id},
    )
    request_span = LLMRequestSpan(span, request_id, n)
    try:
        with trace.use_span(span, end_on_exit=False):
            yield inject_trace_context(trace.set_span_in_context(span))
    except BaseException as e:
        request_span.fail(e)
        raise


def record_request_error(trace_headers: Mapping[str, str] | None, error: BaseException) -> None:
    """Record an error on a request's span, if it has one (before an abort ends it)."""
    if (request_span := find_request_span(trace_headers)) is not None:
        request_span.record_error(error)
