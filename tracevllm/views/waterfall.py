"""The span tree as a waterfall, coloured by process, so the moment a request
crosses from the frontend into the engine core shows at a glance.

The timeline is the point of the view, so it keeps its width: in a narrow
terminal the other columns give way first, in this order: the process id (the
process kind stays, as FE / EC), the start column, the indentation, then the
class of a span whose parent has the same class (``ModelRunner._prepare_inputs``
under ``ModelRunner.execute_model`` reads ``._prepare_inputs``); only then are
names cut. An 80-column terminal shows every span's name, process, duration
and bar.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from rich.bar import Bar
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

from tracevllm.tracing.attributes import SpanAttributes
from tracevllm.tracing.exporters import SpanRecord

PROCESS_STYLE = {
    "client": "green",
    "proxy": "blue",
    "frontend": "cyan",
    "engine_core": "magenta",
    "inprocess": "cyan",
    "worker": "yellow",
}
PROCESS_SHORT = {
    "client": "CL",
    "proxy": "PX",  # tracevllm disagg-proxy
    "frontend": "FE",
    "engine_core": "EC",
    "inprocess": "1P",
    "worker": "W",  # W0, W1 ...: the worker of that global rank
}
# Siblings with the same name beyond this many are folded into one line.
MAX_SAME_NAME = 3
# The timeline never gets narrower than this while another column can give way,
# and, once none can, than the second before names are cut.
MIN_TIMELINE = 30
MIN_TIMELINE_LAST = 20
MAX_NAME = 56


@dataclass(frozen=True)
class _Row:
    depth: int
    name: str
    short: str  # the name without its class when the parent span has the same class
    crossed: bool  # the parent span is in another process
    span: SpanRecord | None  # None: a folded "… N more" line


@dataclass(frozen=True)
class _Layout:
    pid: bool  # "EC 1234" rather than "EC"
    start: bool  # the start-time column
    indent: int  # spaces per tree level
    short: bool  # short names


# From the widest to the narrowest; the first whose timeline fits wins.
LAYOUTS = [
    _Layout(pid=True, start=True, indent=2, short=False),
    _Layout(pid=False, start=True, indent=2, short=False),
    _Layout(pid=False, start=False, indent=2, short=False),
    _Layout(pid=False, start=False, indent=1, short=False),
    _Layout(pid=False, start=False, indent=1, short=True),
]


def _short(name: str, parent: SpanRecord | None) -> str:
    cls, dot, method = name.partition(".")
    if parent is not None and dot and parent.name.partition(".")[0] == cls:
        return f".{method}"
    return name


class Waterfall:
    """A renderable: lays itself out for the width it is given."""

    def __init__(
        self,
        spans: list[SpanRecord],
        width: int | None,
        max_rows: int,
        max_same_name: int = MAX_SAME_NAME,
        collapse: frozenset[str] = frozenset(),
    ) -> None:
        self.spans = spans
        self.width = width  # the timeline's width; None: as wide as fits, up to 40
        self.max_same_name = max_same_name
        self.collapse = collapse
        self.rows = _cut(list(self._rows()), max_rows)
        self.t0 = min((s.start_ns for s in spans), default=0)
        self.total = max(max((s.end_ns for s in spans), default=1) - self.t0, 1)

    def _rows(self) -> Iterator[_Row]:
        """Every row, in tree order. Nothing is left out without a row that
        says so: siblings of one name past ``max_same_name`` fold into one
        ``… N more <name>`` line, and the spans under a span named in
        ``collapse`` into one ``… N spans inside`` line."""
        by_id = {s.span_id: s for s in self.spans}
        children: dict[str | None, list[SpanRecord]] = defaultdict(list)
        for s in self.spans:
            children[s.parent_span_id if s.parent_span_id in by_id else None].append(s)

        def size(span: SpanRecord) -> int:
            """The spans below ``span``."""
            return sum(1 + size(kid) for kid in children.get(span.span_id, []))

        def walk(span: SpanRecord, depth: int, parent: SpanRecord | None) -> Iterator[_Row]:
            crossed = parent is not None and parent.pid != span.pid
            yield _Row(depth, span.name, _short(span.name, parent), crossed, span)
            kids = children.get(span.span_id, [])
            if span.name in self.collapse and kids:
                inside = f"… {size(span)} spans inside"
                yield _Row(depth + 1, inside, inside, False, None)
                return
            seen: dict[str, int] = defaultdict(int)
            for kid in kids:
                seen[kid.name] += 1
                if seen[kid.name] <= self.max_same_name:
                    yield from walk(kid, depth + 1, span)
            for kid_name, n in seen.items():
                if n > self.max_same_name:
                    more = f"… {n - self.max_same_name} more"
                    short = f"{more} {_short(kid_name, span)}"
                    yield _Row(depth + 1, f"{more} {kid_name}", short, False, None)

        for root in children.get(None, []):
            yield from walk(root, 0, None)

    # ------------------------------------------------------------------ layout
    def _label(self, row: _Row, layout: _Layout) -> str:
        mark = "⇄ " if row.crossed else ""
        return " " * (layout.indent * row.depth) + mark + (row.short if layout.short else row.name)

    def _proc(self, span: SpanRecord, layout: _Layout) -> str:
        kind = _kind(span)
        return f"{kind} {span.pid}" if layout.pid else kind

    def _columns(self, layout: _Layout) -> dict[str, int]:
        """Every column's width but the timeline's."""
        spans = [r.span for r in self.rows if r.span is not None]
        widths = {
            "span": min(max((len(self._label(r, layout)) for r in self.rows), default=4), MAX_NAME),
            "proc": max([4, *(len(self._proc(s, layout)) for s in spans)]),
            "ms": max([2, *(len(f"{s.duration_ms:.2f}") for s in spans)]),
        }
        if layout.start:
            widths["start ms"] = max([8, *(len(f"{self._ms(s.start_ns):.1f}") for s in spans)])
        return widths

    def _ms(self, ns: int) -> float:
        return (ns - self.t0) / 1e6

    def layout(self, max_width: int) -> tuple[_Layout, dict[str, int], int]:
        """(layout, column widths, timeline width) for a terminal this wide."""
        for layout in LAYOUTS:
            widths = self._columns(layout)
            room = max_width - sum(widths.values()) - len(widths)  # one space per gap
            if room >= MIN_TIMELINE:
                return layout, widths, min(room, self.width or 40)
        if room >= MIN_TIMELINE_LAST:
            return layout, widths, min(room, self.width or 40)
        # Still too narrow: cut the names.
        widths["span"] = max(max_width - sum(widths.values()) - len(widths) - MIN_TIMELINE_LAST, 12)
        room = max_width - sum(widths.values()) - len(widths)
        return layout, widths, max(min(room, self.width or 40), 1)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        layout, widths, timeline = self.layout(options.max_width)
        table = Table.grid(padding=(0, 1, 0, 0))
        table.add_column(no_wrap=True, overflow="ellipsis", width=widths["span"])
        table.add_column(no_wrap=True, width=widths["proc"])
        if layout.start:
            table.add_column(justify="right", no_wrap=True, width=widths["start ms"])
        table.add_column(justify="right", no_wrap=True, width=widths["ms"])
        table.add_column(no_wrap=True, width=timeline)
        header = ["span", "proc", *(["start ms"] if layout.start else []), "ms"]
        scale = f"0–{self.total / 1e6:.0f} ms"
        table.add_row(*(Text(h, style="bold") for h in header), Text(scale, style="bold"))
        for row in self.rows:
            label = self._label(row, layout)
            if row.span is None:
                table.add_row(Text(label, style="dim"))
                continue
            s, style = row.span, PROCESS_STYLE.get(row.span.process_kind, "white")
            name = Text(label, style=f"bold {style}" if row.crossed else style)
            cells = [name, Text(self._proc(s, layout), style=style)]
            if layout.start:
                cells.append(Text(f"{self._ms(s.start_ns):.1f}"))
            cells.append(Text(f"{s.duration_ms:.2f}"))
            begin, end = s.start_ns - self.t0, s.end_ns - self.t0
            table.add_row(*cells, Bar(self.total, begin, end, width=timeline, color=style))
        pids = ""
        if not layout.pid:  # the pids leave their column for the legend
            by_kind: dict[str, set[int]] = {}
            for s in sorted(self.spans, key=_kind):  # two of a kind behind a proxy: both pids
                by_kind.setdefault(_kind(s), set()).add(s.pid)
            listed = [f"{k} pid {'/'.join(map(str, sorted(p)))}" for k, p in by_kind.items()]
            pids = " (" + ", ".join(listed) + ")"
        kinds = {s.process_kind for s in self.spans}
        legend = "FE frontend · EC engine core · 1P one process" + pids
        if "client" in kinds:
            legend = "CL HTTP client · FE API server · " + legend.split(" · ", 1)[1]
        if "proxy" in kinds:
            legend = legend.replace("FE API server", "PX disagg proxy · FE API server")
        workers = _worker_places(self.spans)
        if workers:
            legend += " · " + ", ".join(workers)
        legend += " · ⇄ parent in the other process"
        yield Group(Text("Span waterfall", style="bold"), Text(legend, style="dim"), table)


def _kind(span: SpanRecord) -> str:
    """The process column: FE, EC ..., and a worker by its global rank (W0, W1 ...)."""
    kind = PROCESS_SHORT.get(span.process_kind, "?")
    rank = span.resource.get(SpanAttributes.RANK)
    return f"{kind}{rank}" if span.process_kind == "worker" and rank is not None else kind


def _worker_places(spans: list[SpanRecord]) -> list[str]:
    """Each worker's place in the parallel layout: "W1 TP 1 PP 0", rank order."""
    places: dict[int, str] = {}
    for s in spans:
        rank = s.resource.get(SpanAttributes.RANK)
        if s.process_kind == "worker" and rank is not None and rank not in places:
            tp, pp = s.resource.get(SpanAttributes.TP_RANK), s.resource.get(SpanAttributes.PP_RANK)
            places[rank] = f"W{rank} TP {tp} PP {pp}"
            dp = s.resource.get(SpanAttributes.DP_RANK)
            if dp:
                places[rank] += f" DP {dp}"
    return [places[rank] for rank in sorted(places)]


def _cut(rows: list[_Row], max_rows: int) -> list[_Row]:
    """At most ``max_rows`` rows; when rows are cut, the last one says how
    many (``… 57 more rows, past max_rows 40``), so a cut never passes for
    the end of the trace."""
    if len(rows) <= max_rows:
        return rows
    kept = rows[: max(max_rows - 1, 0)]
    more = f"… {len(rows) - len(kept)} more rows, past max_rows {max_rows}"
    return [*kept, _Row(0, more, more, False, None)]


def render_waterfall(
    spans: list[SpanRecord],
    width: int | None = None,
    max_rows: int = 200,
    max_same_name: int = MAX_SAME_NAME,
    collapse: frozenset[str] = frozenset(),
) -> Waterfall:
    """The waterfall of ``spans``; ``width``: the timeline's width at most.

    ``max_rows`` rows at most (the last says how many more there were);
    ``max_same_name`` siblings of one name, the rest folded into one line;
    the spans under a span named in ``collapse`` folded into one line."""
    for name, value in (("max_rows", max_rows), ("max_same_name", max_same_name)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return Waterfall(spans, width, max_rows, max_same_name, collapse)
