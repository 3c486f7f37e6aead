"""Draw a whole run from its spans: every step, each completion, the waterfall
(and, with worker processes, which rank holds what).

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
from tracevllm.views.ranks import render_ranks
from tracevllm.views.step import render_step, with_grammar, with_spec
from tracevllm.views.waterfall import render_waterfall

STEP_SPAN = "Scheduler.schedule"
GRAMMAR_SPAN = "Scheduler.get_grammar_bitmask"
UPDATE_SPAN = "Scheduler.update_from_output"
REQUEST_SPAN = "llm_request"
# What a plugged lab computes that the step view does not show already:
# span -> (its attribute, a label). The others show in the step view (01, 02,
# 08: tokens and blocks), the completion panel (06, 09) or not at all.
LAB_VALUES = {"ModelRunner._prepare_inputs": ("tracevllm.slot_mapping", "slot_mapping")}


def _by_step(spans: list[SpanRecord], name: str, attribute: str) -> dict[tuple[Any, Any], Any]:
    """(pid, step id) -> the JSON view a later span of the step carries."""
    return {
        (s.pid, s.attributes.get(SpanAttributes.STEP_ID)): json.loads(s.attributes[attribute])
        for s in spans
        if s.name == name and attribute in s.attributes
    }


def render_report(spans: list[SpanRecord], console: Console, steps: bool = True) -> None:
    if steps:
        # Each step's grammar masks and drafts, by step id (spans after the schedule).
        masks = _by_step(spans, GRAMMAR_SPAN, SpanAttributes.GRAMMAR_VIEW)
        drafts = _by_step(spans, UPDATE_SPAN, SpanAttributes.SPEC_VIEW)
        for span in spans:
            if span.name == STEP_SPAN and SpanAttributes.STEP_VIEW in span.attributes:
                view = json.loads(span.attributes[SpanAttributes.STEP_VIEW])
                key = (span.pid, view["step"])
                view = with_spec(with_grammar(view, masks.get(key, {})), drafts.get(key, {}))
                console.print(render_step(view, span.pid))
    for span in spans:
        if span.name == REQUEST_SPAN:
            console.print(render_completion(span.attributes))
    console.print(render_waterfall(spans))
    ranks = render_ranks(spans)
    if ranks is not None:
        console.print(ranks)


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
        # A step with structured requests waits for its masks, one with drafts
        # for what became of them (later spans of the same step).
        self._pending: tuple[dict[str, Any], int | None] | None = None
        self._awaiting: set[str] = set()

    def _flush(self) -> None:
        if self._pending is not None:
            view, pid = self._pending
            self._pending = None
            self.console.print(render_step(view, pid))

    def _arrived(self, what: str) -> None:
        self._awaiting.discard(what)
        if not self._awaiting:
            self._flush()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        attrs: dict[str, Any] = dict(span.attributes or {})
        if span.name == STEP_SPAN and SpanAttributes.STEP_VIEW in attrs:
            self._flush()
            pid = span.resource.attributes.get("process.pid")
            view = json.loads(str(attrs[SpanAttributes.STEP_VIEW]))
            self._pending = (view, int(pid) if isinstance(pid, int) else None)
            requests = view["requests"]
            self._awaiting = {
                *(["grammar"] if any(r.get("structured") for r in requests) else []),
                *(["spec"] if any(r.get("spec_token_ids") for r in requests) else []),
            }
            self._arrived("schedule")
        elif span.name == GRAMMAR_SPAN and SpanAttributes.GRAMMAR_VIEW in attrs:
            if self._pending is not None:
                with_grammar(self._pending[0], json.loads(str(attrs[SpanAttributes.GRAMMAR_VIEW])))
            self._arrived("grammar")
        elif span.name == UPDATE_SPAN and self._awaiting == {"spec"}:
            if self._pending is not None and SpanAttributes.SPEC_VIEW in attrs:
                with_spec(self._pending[0], json.loads(str(attrs[SpanAttributes.SPEC_VIEW])))
            self._arrived("spec")
        elif span.name == REQUEST_SPAN:
            self.console.print(render_completion(attrs))
        elif span.name in LAB_VALUES and attrs.get(LABS_ATTRIBUTE):
            key, label = LAB_VALUES[span.name]
            self.console.print(render_lab_value(attrs[LABS_ATTRIBUTE], label, attrs.get(key)))

    def shutdown(self) -> None:
        self._flush()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
