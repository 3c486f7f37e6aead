"""The span tree as a waterfall, coloured by process, so the moment a request
crosses from the frontend into the engine core shows at a glance."""

from __future__ import annotations

from collections import defaultdict

from rich.bar import Bar
from rich.table import Table
from rich.text import Text

from tracevllm.tracing.exporters import SpanRecord

PROCESS_STYLE = {"frontend": "cyan", "engine_core": "magenta", "inprocess": "cyan"}
PROCESS_SHORT = {"frontend": "FE", "engine_core": "EC", "inprocess": "1P"}
# Siblings with the same name beyond this many are folded into one line.
MAX_SAME_NAME = 3


def render_waterfall(spans: list[SpanRecord], width: int = 40, max_rows: int = 200) -> Table:
    by_id = {s.span_id: s for s in spans}
    children: dict[str | None, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in by_id else None
        children[parent].append(s)
    t0 = min((s.start_ns for s in spans), default=0)
    t1 = max((s.end_ns for s in spans), default=1)
    total = max(t1 - t0, 1)

    table = Table(
        title="Span waterfall · FE = frontend, EC = engine core, 1P = one process · "
        "⇄ = crossed the process boundary",
        title_justify="left",
    )
    table.add_column("span", no_wrap=True, overflow="ellipsis", max_width=56)
    table.add_column("pid", no_wrap=True)
    table.add_column("start ms", justify="right", no_wrap=True)
    table.add_column("ms", justify="right", no_wrap=True)
    table.add_column("timeline", width=width, no_wrap=True)
    rows = 0

    def add(span: SpanRecord, depth: int, parent: SpanRecord | None) -> None:
        nonlocal rows
        if rows >= max_rows:
            return
        rows += 1
        style = PROCESS_STYLE.get(span.process_kind, "white")
        crossed = parent is not None and parent.pid != span.pid
        name = Text("  " * depth + ("⇄ " if crossed else "") + span.name, style=style)
        if crossed:
            name.stylize("bold")
        table.add_row(
            name,
            Text(f"{PROCESS_SHORT.get(span.process_kind, '?')} {span.pid}", style=style),
            f"{(span.start_ns - t0) / 1e6:.1f}",
            f"{span.duration_ms:.2f}",
            Bar(total, span.start_ns - t0, span.end_ns - t0, width=width, color=style),
        )
        seen: dict[str, int] = defaultdict(int)
        kids = children.get(span.span_id, [])
        for kid in kids:
            seen[kid.name] += 1
            if seen[kid.name] <= MAX_SAME_NAME:
                add(kid, depth + 1, span)
        for kid_name, count in seen.items():
            if count > MAX_SAME_NAME and rows < max_rows:
                rows += 1
                table.add_row(
                    Text("  " * (depth + 1) + f"… {count - MAX_SAME_NAME} more {kid_name}"),
                    "",
                    "",
                    "",
                    "",
                )

    for root in children.get(None, []):
        add(root, 0, None)
    return table
