"""Writing ``spans.jsonl``, reading it back, and writing it as a Perfetto /
Chrome trace.

tracevllm's own (vLLM only exports OTLP). ``spans.jsonl`` is OTLP JSON lines,
one ``{"resourceSpans": ...}`` batch per line, from both processes.
``trace.perfetto.json`` is Chrome's trace-event format: one process track per
pid (named frontend / engine_core), and within a process one thread track per
set of properly nested spans, because slices on one track must nest.

Why an encoder of its own, when OTel ships one: CPU, measured at tracing's
default ``request`` detail. On ``make bench``'s workload (64 chat prompts,
4885 tokens, 2211 spans; one generate, the engine in process, one compute
thread), OTel's encoder took 0.82-1.10 s of CPU to write the spans and
``encode_spans`` 0.14-0.23 s, against 20-24 s for the generate itself: it
saves 3.2-3.8 % of the generate's CPU (``python
benchmarks/bench_span_export.py --detail request``, four runs on a shared
2-core machine, 2026-12-02, load 1.3 to 6). The line's structure is
written as text, and each attribute's value made an OTLP AnyValue dict
(``_encode_value``) for ``json``, but for lists of ints or strings, which
are joined as text (``_value_json``): the engine's spans carry a dozen such
lists a step (token ids, slots, positions, request ids). Encoding every
attribute of a ``request`` generate of that workload took 0.233 s that way
and takes 0.102 s joined (best of five, replayed from its spans.jsonl,
2026-12-03). In the engine, beside the model, the exporter's thread paid
about twice the replay: py-spy counted 0.46 s in ``_key_value`` on a 47 s
generate (quiet ``make bench-tracing``, before this change), when
``request`` stood at 3.09 % of the engine thread, half of it the exporter;
with the lists joined, 2.26 %. One finer cut was taken out: each repeated
attribute encoded once saved 0.07 % at ``request``. Single str, int, bool
and float values written as text too (2026-12-04): 2.5 us a value through
``_encode_value`` and ``json``, 0.35 us as text; the spans of a ``request``
generate then took 57.8 us each to write, against 71.5 before (``python
benchmarks/bench_span_export.py --detail request --repeats 3``, one run of
each, 2-core AMD EPYC).
"""

from __future__ import annotations

import base64
import json
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanContext

from tracevllm.logger import init_logger

logger = init_logger(__name__)


class OTLPJsonFileExporter(SpanExporter):
    """Appends each batch of spans to a file as one line of OTLP JSON.

    The line is what OTel's own ``FileSpanExporter``
    (opentelemetry-exporter-otlp-json-file) writes, byte for byte
    (tests/test_tracing.py compares them), but written as text by
    ``encode_spans``: OTel's encoder builds a message object for every
    attribute value first. See the module docstring for what that saves.
    Each line is handed whole to ``write(2)`` on an ``O_APPEND`` file, which
    a regular file takes in one piece, so the two processes' lines do not
    interleave.
    """

    def __init__(self, path: str) -> None:
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._fd is None:
            logger.warning("spans exported after the exporter was shut down were dropped")
            return SpanExportResult.FAILURE
        if not spans:
            return SpanExportResult.SUCCESS
        data = (encode_spans(spans) + "\n").encode()
        with self._lock:
            if self._fd is None:  # shut down while this batch was encoded
                return SpanExportResult.FAILURE
            try:
                while data:
                    data = data[os.write(self._fd, data) :]
            except OSError:
                logger.exception("could not write spans to the trace file")
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is buffered: every batch is written as it comes


def encode_spans(spans: Sequence[ReadableSpan]) -> str:
    """An OTLP ``ExportTraceServiceRequest`` as one line of JSON: spans grouped
    by resource (the process), then by instrumentation scope.

    Written as text, field by field, rather than as OTel's message objects
    turned into dicts for ``json.dumps`` (the module docstring says what
    that saves).
    """
    # Grouped by identity: one provider per process, so one resource object.
    by_resource: dict[int, tuple[Any, dict[int, tuple[Any, list[str]]]]] = {}
    for span in spans:
        resource = span.resource
        _, scopes = by_resource.setdefault(id(resource), (resource, {}))
        scope = span.instrumentation_scope
        scopes.setdefault(id(scope), (scope, []))[1].append(_span(span))
    resource_spans = []
    for resource, scopes in by_resource.values():
        scope_spans = []
        for scope, encoded in scopes.values():
            scope_json = "{}"
            if scope is not None:
                scope_json = _object(
                    ("name", _string(scope.name)),
                    ("version", _string(scope.version or "")),
                    ("attributes", _attribute_list(scope.attributes)),
                )
            schema_url = scope.schema_url if scope is not None else ""
            scope_spans.append(
                _object(
                    ("scope", scope_json),
                    ("spans", _array(encoded)),
                    ("schemaUrl", _string(schema_url)),
                    keep="scope",
                )
            )
        resource_spans.append(
            _object(
                ("resource", _object(("attributes", _attribute_list(resource.attributes)))),
                ("scopeSpans", _array(scope_spans)),
                ("schemaUrl", _string(resource.schema_url)),
                keep="resource",
            )
        )
    return _object(("resourceSpans", _array(resource_spans)), keep="resourceSpans")


def _span(span: ReadableSpan) -> str:
    """One span, its fields in the proto's order; those at their default are
    left out (proto3 JSON), but for ``status``, which OTel always writes.
    Written field by field rather than through ``_object``, as the rarer
    events and links are: a busy step writes thousands of spans."""
    context, parent, status = span.context, span.parent, span.status
    # Read once: each of these properties makes a new tuple or read-only view.
    attributes, events, links = span.attributes, span.events, span.links
    text = f'{{"traceId":{_trace_id(context)},"spanId":{_span_id(context)}'
    if context is not None and context.trace_state:
        text += f',"traceState":{_trace_state(context)}'
    if parent is not None:
        text += f',"parentSpanId":{_span_id(parent)}'
    text += f',"flags":{_flags(parent)}'
    if span.name:
        text += f',"name":{_string(span.name)}'
    # OTLP counts kinds from SPAN_KIND_UNSPECIFIED = 0.
    text += f',"kind":{span.kind.value + 1}'
    if span.start_time:
        text += f',"startTimeUnixNano":"{span.start_time}"'
    if span.end_time:
        text += f',"endTimeUnixNano":"{span.end_time}"'
    if attributes:
        text += f',"attributes":{_attribute_list(attributes)}'
    if span.dropped_attributes:
        text += f',"droppedAttributesCount":{span.dropped_attributes}'
    if events:
        text += f',"events":{_array([_event(event) for event in events])}'
    if span.dropped_events:
        text += f',"droppedEventsCount":{span.dropped_events}'
    if links:
        text += f',"links":{_array([_link(link) for link in links])}'
    if span.dropped_links:
        text += f',"droppedLinksCount":{span.dropped_links}'
    status_json = _object(
        ("message", _string(status.description or "")), ("code", str(status.status_code.value))
    )
    return f'{text},"status":{status_json}}}'


def _event(event: Event) -> str:
    # A timestamp of 0 (none) is written '""', a default, so left out.
    return _object(
        ("timeUnixNano", f'"{event.timestamp or ""}"'),
        ("name", _string(event.name)),
        ("attributes", _attribute_list(event.attributes)),
        ("droppedAttributesCount", str(event.dropped_attributes)),
    )


def _link(link: Link) -> str:
    """Field by field, as _span: a step links to every request it served."""
    context, attributes = link.context, link.attributes
    text = f'{{"traceId":{_trace_id(context)},"spanId":{_span_id(context)}'
    if attributes:
        text += f',"attributes":{_attribute_list(attributes)}'
    if link.dropped_attributes:
        text += f',"droppedAttributesCount":{link.dropped_attributes}'
    return f'{text},"flags":{_flags(context)}}}'


# The JSON of a field at its default, which proto3 JSON leaves out.
_DEFAULTS = frozenset(('""', "0", "[]", "{}"))


def _object(*fields: tuple[str, str], keep: str = "") -> str:
    """A JSON object from (name, JSON text) pairs, in the proto's order,
    without those at their default (but ``keep``, which OTel always writes)."""
    return (
        "{"
        + ",".join(
            f'"{name}":{text}' for name, text in fields if text not in _DEFAULTS or name == keep
        )
        + "}"
    )


def _array(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


# What json.dumps does to a str (ensure_ascii), without its wrapper.
_string = encode_basestring_ascii

# What is not a plain string, encoded as OTel's file exporter does: no spaces.
_dumps = json.JSONEncoder(separators=(",", ":")).encode


def _trace_id(context: SpanContext | None) -> str:
    # All zeros for an invalid context, as OTel writes it (16 zero bytes).
    return f'"{context.trace_id if context else 0:032x}"'


def _span_id(context: SpanContext | None) -> str:
    return f'"{context.span_id if context else 0:016x}"'


def _trace_state(context: SpanContext | None) -> str:
    state = context.trace_state if context else None
    return _string(",".join(f"{key}={value}" for key, value in state.items()) if state else "")


def _flags(context: SpanContext | None) -> str:
    """SpanFlags: bit 8 says whether bit 9 (the parent is remote) is known."""
    return "768" if context is not None and context.is_remote else "256"


def _attribute_list(attributes: Mapping[str, Any] | None) -> str:
    return _array([_key_value(key, value) for key, value in (attributes or {}).items()])


def _key_value(key: str, value: Any) -> str:
    """One OTLP KeyValue."""
    return f'{{"key":{_string(key)},"value":{_value_json(value)}}}'


def _value_json(value: Any) -> str:
    """An OTLP AnyValue's JSON. A single str, int, bool or finite float (most
    attributes) and a list of ints or of strings (the engine's token ids,
    slots, positions, request ids) are written as text, instead of made into
    dicts for ``json`` (see the module docstring for what that saves);
    anything else goes through ``_encode_value``."""
    kind = type(value)  # type, not isinstance: bool is an int, and is written apart
    if kind is str:
        return '{"stringValue":' + _string(value) + "}"
    if kind is int:
        return '{"intValue":"' + str(value) + '"}'
    if kind is bool:
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    if kind is float and math.isfinite(value):
        return '{"doubleValue":' + float.__repr__(value) + "}"  # as json writes it
    if isinstance(value, (tuple, list)) and value:
        if all(type(v) is int for v in value):  # not bool: type, not isinstance
            items = [f'{{"intValue":"{v}"}}' for v in value]
        elif all(type(v) is str for v in value):
            items = [f'{{"stringValue":{_string(v)}}}' for v in value]
        else:
            return _dumps(_encode_value(value))
        return '{"arrayValue":{"values":[' + ",".join(items) + "]}}"
    return _dumps(_encode_value(value))


def _encode_value(value: Any) -> dict[str, Any]:
    """An OTLP AnyValue (ints as strings: JSON cannot carry all of int64)."""
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        if math.isfinite(value):
            return {"doubleValue": value}
        # Proto3 JSON spells the three values JSON has no number for.
        return {"doubleValue": "NaN" if math.isnan(value) else ("-" * (value < 0)) + "Infinity"}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode()}
    if isinstance(value, Sequence):
        values = [_encode_value(v) for v in value]
        return {"arrayValue": {"values": values} if values else {}}
    if isinstance(value, Mapping):
        values = [{"key": str(k), "value": _encode_value(v)} for k, v in value.items()]
        return {"kvlistValue": {"values": values} if values else {}}
    raise TypeError(f"an attribute value cannot be a {type(value).__name__}: {value!r}")


@dataclass(slots=True)
class SpanRecord:
    """One span as read from OTLP JSON, with its process's resource attributes."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return int(self.resource.get("process.pid", 0))

    @property
    def process_kind(self) -> str:
        return str(self.resource.get("tracevllm.process_kind", "?"))

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _any_value(value: dict[str, Any]) -> Any:
    """Decode an OTLP JSON AnyValue (ints arrive as strings)."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_any_value(v) for v in value["arrayValue"].get("values", [])]
    return None


def _attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {item["key"]: _any_value(item["value"]) for item in items or []}


def read_spans_jsonl(path: str) -> list[SpanRecord]:
    """All spans in an OTLP JSON lines file, sorted by start time."""
    spans: list[SpanRecord] = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                batch = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no} is not OTLP JSON: {e}") from None
            for rs in batch.get("resourceSpans", []):
                resource = _attributes(rs.get("resource", {}).get("attributes"))
                for ss in rs.get("scopeSpans", []):
                    for s in ss.get("spans", []):
                        spans.append(
                            SpanRecord(
                                trace_id=s["traceId"],
                                span_id=s["spanId"],
                                parent_span_id=s.get("parentSpanId") or None,
                                name=s["name"],
                                start_ns=int(s["startTimeUnixNano"]),
                                end_ns=int(s["endTimeUnixNano"]),
                                attributes=_attributes(s.get("attributes")),
                                resource=resource,
                                links=[(k["traceId"], k["spanId"]) for k in s.get("links", [])],
                            )
                        )
    spans.sort(key=lambda s: (s.start_ns, -s.end_ns))
    return spans


def _assign_tracks(spans: list[SpanRecord]) -> dict[str, int]:
    """Greedy interval packing: a span joins the first track whose open spans
    all contain it, so every track nests properly."""
    tracks: list[list[SpanRecord]] = []  # per track, the stack of open spans
    track_of: dict[str, int] = {}
    for span in spans:  # sorted by start, longest first on ties
        for tid, stack in enumerate(tracks):
            while stack and stack[-1].end_ns <= span.start_ns:
                stack.pop()
            if not stack or stack[-1].end_ns >= span.end_ns:
                stack.append(span)
                track_of[span.span_id] = tid
                break
        else:
            tracks.append([span])
            track_of[span.span_id] = len(tracks) - 1
    return track_of


def to_perfetto(spans: list[SpanRecord]) -> dict[str, Any]:
    """Chrome trace-event JSON (``ts``/``dur`` in microseconds)."""
    events: list[dict[str, Any]] = []
    by_pid: dict[int, list[SpanRecord]] = {}
    for span in spans:
        by_pid.setdefault(span.pid, []).append(span)
    t0 = min((s.start_ns for s in spans), default=0)
    for sort_index, (pid, proc_spans) in enumerate(sorted(by_pid.items())):
        kind = proc_spans[0].process_kind
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{kind} ({pid})"}}
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "args": {"sort_index": sort_index},
            }
        )
        track_of = _assign_tracks(proc_spans)
        for tid in sorted(set(track_of.values())):
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": tid,
                    "args": {"name": f"{kind} track {tid}"},
                }
            )
        for span in proc_spans:
            args = {k: v for k, v in span.attributes.items() if not k.startswith("tracevllm.view")}
            args["trace_id"] = span.trace_id
            args["span_id"] = span.span_id
            events.append(
                {
                    "ph": "X",
                    "name": span.name,
                    "cat": kind,
                    "pid": pid,
                    "tid": track_of[span.span_id],
                    "ts": (span.start_ns - t0) / 1e3,
                    "dur": max(span.end_ns - span.start_ns, 1) / 1e3,
                    "args": args,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_perfetto(spans: list[SpanRecord], path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_perfetto(spans), f)
