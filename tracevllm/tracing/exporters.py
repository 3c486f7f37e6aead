"""Reading ``spans.jsonl`` back, and writing it as a Perfetto / Chrome trace.

tracevllm's own (vLLM only exports OTLP). ``spans.jsonl`` is OTLP JSON lines,
one ``{"resourceSpans": ...}`` batch per line, from both processes.
``trace.perfetto.json`` is Chrome's trace-event format: one process track per
pid (named frontend / engine_core), and within a process one thread track per
set of properly nested spans, because slices on one track must nest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


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
