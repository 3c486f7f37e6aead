"""Which rank holds what: one row per worker, drawn from its spans.

tracevllm's own (vLLM has no such view). Each worker process has its own
TracerProvider, whose resource names its global, TP and PP rank; its spans
say the rest: the decoder layers it ran (``tracevllm.layer``), its KV cache
tensor (``tracevllm.kv_cache_shape``: ``[pages, 2, slots per page, KV heads,
head size]``, the KV heads being this rank's only), the pages the step wrote
(layer 0's slot mapping: every rank writes the same pages, each with its own
heads), and at detail "full" its collectives (count, bytes, milliseconds).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tracevllm.tracing.attributes import SpanAttributes
from tracevllm.tracing.exporters import SpanRecord

KV_WRITE_SPAN = "reshape_and_cache_flash"
COMM_PREFIX = "GroupCoordinator."


@dataclass
class RankRow:
    rank: int
    tp_rank: Any
    pp_rank: Any
    pid: int
    layers: set[int] = field(default_factory=set)
    kv_cache_shape: list[int] | None = None
    pages: set[int] = field(default_factory=set)
    # op -> [calls, bytes, milliseconds]
    comms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0.0]))


def rank_rows(spans: list[SpanRecord]) -> list[RankRow]:
    """One row per worker rank, in rank order (empty without worker spans)."""
    rows: dict[int, RankRow] = {}
    for s in spans:
        rank = s.resource.get(SpanAttributes.RANK)
        if s.process_kind != "worker" or rank is None:
            continue
        row = rows.get(rank)
        if row is None:
            row = rows[rank] = RankRow(
                rank,
                s.resource.get(SpanAttributes.TP_RANK),
                s.resource.get(SpanAttributes.PP_RANK),
                s.pid,
            )
        layer = s.attributes.get("tracevllm.layer")
        if isinstance(layer, int):
            row.layers.add(layer)
        if s.name == KV_WRITE_SPAN:
            row.kv_cache_shape = s.attributes.get("tracevllm.kv_cache_shape", row.kv_cache_shape)
            slots = s.attributes.get("tracevllm.slot_mapping")
            if slots and row.kv_cache_shape:
                block_size = row.kv_cache_shape[2]
                row.pages.update(slot // block_size for slot in slots if slot >= 0)
        if s.name.startswith(COMM_PREFIX):
            totals = row.comms[s.name[len(COMM_PREFIX) :]]
            totals[0] += 1
            totals[1] += s.attributes.get(SpanAttributes.COMM_BYTES, 0)
            totals[2] += s.attributes.get(SpanAttributes.COMM_MS, 0.0)
    return [rows[rank] for rank in sorted(rows)]


def _span_of(values: set[int]) -> str:
    """``0–29`` for a run, else the values themselves, shortened."""
    if not values:
        return "–"
    ordered = sorted(values)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 2:
        return f"{ordered[0]}–{ordered[-1]}"
    text = " ".join(map(str, ordered[:8]))
    return text + (" …" if len(ordered) > 8 else "")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def render_ranks(spans: list[SpanRecord]) -> Group | None:
    """The ranks table (and, at detail "full", their collectives), or None for
    a run without worker processes."""
    rows = rank_rows(spans)
    if not rows:
        return None
    table = Table(box=None, pad_edge=False, header_style="bold")
    for header in ("worker", "TP", "PP", "layers", "KV heads", "pages written"):
        table.add_column(header, no_wrap=True)
    for row in rows:
        heads, pages = "–", _span_of(row.pages)
        if row.kv_cache_shape and len(row.kv_cache_shape) == 5:
            num_pages, _, _, num_heads, head_size = row.kv_cache_shape
            heads = f"{num_heads} × {head_size}"
            pages += f" of {num_pages}"
        worker = Text(f"W{row.rank}", style="yellow")
        table.add_row(
            worker, str(row.tp_rank), str(row.pp_rank), _span_of(row.layers), heads, pages
        )
    note = (
        "Every rank holds every page, with its own KV heads only (heads × head size); "
        "the layers as traced (every one at detail full)."
    )
    parts: list[Any] = [Text("Ranks", style="bold"), Text(note, style="dim"), table]
    if any(row.comms for row in rows):
        comms = Table(box=None, pad_edge=False, header_style="bold")
        for header in ("worker", "collective", "calls", "bytes", "ms"):
            comms.add_column(
                header,
                no_wrap=True,
                justify="left" if header in ("worker", "collective") else "right",
            )
        for row in rows:
            for op, (calls, nbytes, ms) in sorted(row.comms.items()):
                worker = Text(f"W{row.rank}", style="yellow")
                comms.add_row(worker, op, f"{calls:.0f}", _bytes(nbytes), f"{ms:.2f}")
        parts += [Text("Collectives, per rank", style="bold"), comms]
    return Group(*parts)
