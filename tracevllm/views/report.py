"""Draw a whole run from its spans: every step, each completion, the waterfall.

Used for ``views.svg`` / ``views.html`` after ``tracevllm trace``, for
``tracevllm view spans.jsonl``, and (one span at a time) for the live view.
"""

from __future__ import annotations

import json
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from rich.console import Console
from rich.text import Text

from tracevllm.labs import LABS_ATTRIBUTE
from tracevllm.tracing.attributes import SpanAttributes
from tracevllm.tracing.exporters import SpanRecord
from tracevllm.views.completion import render_completion
from tracevllm.views.step import render_step, with_grammar
from tracevllm.views.waterfall import render_waterfall

STEP_SPAN = "Scheduler.schedule"
GRAMMAR_SPAN = "Scheduler.get_grammar_bitmask"
REQUEST_SPAN = "llm_request"
# What a plugged lab computes that the step view does not show already:
# span -> (its attribute, a label). The others show in the step view (01, 02,
# 08: tokens and blocks), the completion panel (06, 09) or not at all.
LAB_VALUES = {"ModelRunner._prepare_inputs": ("tracevllm.slot_mapping", "slot_mapping")}


def render_report(spans: list[SpanRecord], console: Console, steps: bool = True) -> None:
    if steps:
        # Each step's grammar masks, by step id (a span of their own, after the schedule).
        masks = {
            (s.pid, s.attributes.get(SpanAttributes.STEP_ID)): s.attributes[
                SpanAttributes.GRAMMAR_VIEW
            ]
            for s in spans
            if s.name == GRAMMAR_SPAN and SpanAttributes.GRAMMAR_VIEW in s.attributes
        }
        for span in spans:
            if span.name == STEP_SPAN and SpanAttributes.STEP_VIEW in span.attributes:
                view = json.loads(span.attributes[SpanAttributes.STEP_VIEW])
                mask = masks.get((span.pid, view["step"]))
                if mask is not None:
                    view = with_grammar(view, json.loads(mask))
                console.print(render_step(view, span.pid))
    for span in spans:
        if span.name == REQUEST_SPAN:
            console.print(render_completion(span.attributes))
    console.print(render_waterfall(spans))


def render_lab_value(labs: Any, label: str, value: Any) -> Text:
    """``lab 03 (compute_slot_mapping from ...): slot_mapping [16 17 ...]``."""
    values = " ".join(str(v) for v in value) if isinstance(value, (list, tuple)) else value
    return Text.assemble(
        (f"lab {', '.join(labs)}", "bold yellow"), f" · {label} ", (f"[{values}]", "yellow")
    )


class RichViewProcessor(SpanProcessor):
    """Draws each step (and each finished request) as its span ends."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        # A step with structured requests waits for its masks (the next span).
        self._pending: tuple[dict[str, Any], int | None] | None = None

    def _flush(self, allowed: dict[str, int] | None = None) -> None:
        if self._pending is not None:
            view, pid = self._pending
            self._pending = None
            self.console.print(render_step(with_grammar(view, allowed or {}), pid))

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        attrs: dict[str, Any] = dict(span.attributes or {})
        if span.name == STEP_SPAN and SpanAttributes.STEP_VIEW in attrs:
            self._flush()
            pid = span.resource.attributes.get("process.pid")
            view = json.loads(str(attrs[SpanAttributes.STEP_VIEW]))
            self._pending = (view, int(pid) if isinstance(pid, int) else None)
            if not any(req.get("structured") for req in view["requests"]):
                self._flush()
        elif span.name == GRAMMAR_SPAN and SpanAttributes.GRAMMAR_VIEW in attrs:
            self._flush(json.loads(str(attrs[SpanAttributes.GRAMMAR_VIEW])))
        elif span.name == REQUEST_SPAN:
            self.console.print(render_completion(attrs))
        elif span.name in LAB_VALUES and attrs.get(LABS_ATTRIBUTE):
            key, label = LAB_VALUES[span.name]
            self.console.print(render_lab_value(attrs[LABS_ATTRIBUTE], label, attrs.get(key)))

    def shutdown(self) -> None:
        self._flush()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
