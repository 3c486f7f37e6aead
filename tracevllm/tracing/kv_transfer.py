"""Spans of KV connector transfers, and the trace context they carry between engines.

A connector moves a request's KV layer by layer inside the forward; a span
per layer would be hundreds per request. So the connector keeps one
``KVTransferRecord`` per request and direction for the step (bytes, layers,
the first start and last end), and ``record_kv_transfer`` makes it one span,
``<Connector>.save_kv_layer`` or ``<Connector>.wait_for_layer_load``, in the
request's trace (its ``trace_headers``), once the forward is done.

Between engines the trace context travels in ``kv_transfer_params``, as W3C
``traceparent``/``tracestate`` keys beside the connector's own: the
producer's finished request returns them (``add_trace_context``), and the
consumer's request, given them, continues that trace
(``remote_trace_context``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link

from tracevllm.tracing import (
    TRACE_HEADERS,
    extract_trace_context,
    get_tracer,
    is_enabled,
    own_trace_if_untraced,
)


@dataclass(slots=True)
class KVTransferRecord:
    """What one request's save or load moved in one step."""

    connector: str
    direction: str  # "save" | "load"
    request_id: str
    trace_headers: Mapping[str, str] | None
    num_blocks: int
    num_tokens: int
    num_bytes: int = 0
    num_layers: int = 0
    start_ns: int = 0
    end_ns: int = 0
    # The first failure; the request's later layers are skipped.
    error: str | None = None
    # The producer's context, for a load (a link: where the KV came from).
    remote_trace_headers: Mapping[str, str] | None = None

    def add(self, num_bytes: int, start_ns: int, end_ns: int) -> None:
        """One layer moved."""
        self.num_bytes += num_bytes
        self.num_layers += 1
        self.start_ns = start_ns if not self.start_ns else min(self.start_ns, start_ns)
        self.end_ns = max(self.end_ns, end_ns)


def record_kv_transfer(record: KVTransferRecord) -> None:
    """The record as a span in the request's trace (nothing with tracing off)."""
    if not is_enabled():
        return
    method = "save_kv_layer" if record.direction == "save" else "wait_for_layer_load"
    start_ns = record.start_ns or time.time_ns()
    end_ns = max(record.end_ns, start_ns)
    links = []
    if (remote := extract_trace_context(record.remote_trace_headers)) is not None:
        links.append(Link(trace.get_current_span(remote).get_span_context()))
    span = get_tracer().start_span(
        f"{record.connector}.{method}",
        # A request without trace headers: the step's span, or in a poll of
        # pending transfers (which makes none) a trace of the transfer's own.
        context=extract_trace_context(record.trace_headers) or own_trace_if_untraced(),
        start_time=start_ns,
        links=links,
        attributes={
            "tracevllm.kv_transfer.connector": record.connector,
            "tracevllm.kv_transfer.direction": record.direction,
            "tracevllm.kv_transfer.request_id": record.request_id,
            "tracevllm.kv_transfer.num_bytes": record.num_bytes,
            "tracevllm.kv_transfer.num_blocks": record.num_blocks,
            "tracevllm.kv_transfer.num_tokens": record.num_tokens,
            "tracevllm.kv_transfer.num_layers": record.num_layers,
            "tracevllm.kv_transfer.ms": (end_ns - start_ns) / 1e6,
        },
    )
    if record.error is not None:
        span.set_status(trace.StatusCode.ERROR, record.error)
    span.end(end_time=end_ns)


def add_trace_context(
    params: dict[str, Any], trace_headers: Mapping[str, str] | None
) -> dict[str, Any]:
    """``params`` with the request's W3C trace headers added (if it has any)."""
    if trace_headers:
        params.update({h: trace_headers[h] for h in TRACE_HEADERS if h in trace_headers})
    return params


def kv_transfer_trace_headers(params: Any) -> dict[str, str] | None:
    """The producer's trace headers in a request's
    ``extra_args["kv_transfer_params"]`` (None if it has none)."""
    extra_args = getattr(params, "extra_args", None)
    if not isinstance(extra_args, dict):
        return None
    params = extra_args.get("kv_transfer_params")
    return remote_trace_headers(params if isinstance(params, dict) else None)


def remote_trace_headers(kv_transfer_params: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The producer's trace headers inside a consumer's ``kv_transfer_params``."""
    if not kv_transfer_params:
        return None
    headers = {h: v for h in TRACE_HEADERS if isinstance(v := kv_transfer_params.get(h), str)}
    return headers or None
