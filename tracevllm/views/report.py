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
from tracevllm.views.step import render_step
from tracevllm.views.waterfall import render_waterfall

STEP_SPAN = "Scheduler.schedule"
REQUEST_SPAN = "llm_request"
# What a plugged lab computes that the step view does not show already:
# span -> (its attribute, a label). The others show in the step view (01, 02,
# 08: tokens and blocks), the completion panel (06, 09) or not at all.
LAB_VALUES = {"ModelRunner._prepare_inputs": ("tracevllm.slot_mapping", "slot_mapping")}


def render_report(spans: list[SpanRecord], console: Console, steps: bool = True) -> None:
    if steps:
        for span in spans:
            if span.name == STEP_SPAN and SpanAttributes.STEP_VIEW in span.attributes:
                view = json.loads(span.attributes[SpanAttributes.STEP_VIEW])
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

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        attrs: dict[str, Any] = dict(span.attributes or {})
        if span.name == STEP_SPAN and SpanAttributes.STEP_VIEW in attrs:
            pid = span.resource.attributes.get("process.pid")
            view = json.loads(str(attrs[SpanAttributes.STEP_VIEW]))
            self.console.print(render_step(view, int(pid) if isinstance(pid, int) else None))
        elif span.name == REQUEST_SPAN:
            self.console.print(render_completion(attrs))
        elif span.name in LAB_VALUES and attrs.get(LABS_ATTRIBUTE):
            key, label = LAB_VALUES[span.name]
            self.console.print(render_lab_value(attrs[LABS_ATTRIBUTE], label, attrs.get(key)))

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
