"""Which rank holds what: one row per worker, drawn from its spans.

tracevllm's own (vLLM has no such view). Each worker process has its own
TracerProvider, whose resource says where it stands and what it holds
(tracing/ranks.py): its global, TP, PP and DP rank, the query heads and KV
heads of its attention layers by index (a KV head on several ranks when
there are fewer KV heads than TP ranks, as ``QKVParallelLinear`` copies it),
the decoder layers of its stage, and what one KV page costs it. Its spans
say the rest: its KV cache tensor (``tracevllm.kv_cache_shape``: ``[pages, 2,
slots per page, KV heads, head size]``, on the KV write span), the pages the
step wrote (layer 0's slot mapping: every rank writes the same pages, each
with its own heads), the layers it traced (``tracevllm.layer``), and at
detail "full" its collectives (count, bytes, milliseconds).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tracevllm.tracing import ranks as held
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
    dp_rank: Any = None
    # What the worker holds (its resource): head indices, [start, end) layers.
    q_heads: list[int] = field(default_factory=list)
    kv_heads: list[int] = field(default_factory=list)
    kv_head_replicas: int = 1
    total_q_heads: int | None = None
    total_kv_heads: int | None = None
    layer_range: list[int] | None = None
    kv_bytes_per_block: int | None = None
    # Pages in its KV cache: its own tensor's, or (a stage that traced no KV
    # write) its engine's, since every rank gets the same KV cache config.
    num_blocks: int | None = None
    # The layers it traced (all of them at detail "full").
    layers: set[int] = field(default_factory=set)
    kv_cache_shape: list[int] | None = None
    pages: set[int] = field(default_factory=set)
    # op -> [calls, bytes, milliseconds]
    comms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0.0]))

    @property
    def kv_cache_bytes(self) -> int | None:
        if self.num_blocks is None or self.kv_bytes_per_block is None:
            return None
        return self.num_blocks * self.kv_bytes_per_block


def _new_row(s: SpanRecord) -> RankRow:
    r = s.resource
    return RankRow(
        rank=r[SpanAttributes.RANK],
        tp_rank=r.get(SpanAttributes.TP_RANK),
        pp_rank=r.get(SpanAttributes.PP_RANK),
        pid=s.pid,
        dp_rank=r.get(SpanAttributes.DP_RANK),
        q_heads=list(r.get(held.Q_HEADS) or []),
        kv_heads=list(r.get(held.KV_HEADS) or []),
        kv_head_replicas=r.get(held.KV_HEAD_REPLICAS) or 1,
        total_q_heads=r.get(held.TOTAL_Q_HEADS),
        total_kv_heads=r.get(held.TOTAL_KV_HEADS),
        layer_range=r.get(held.LAYER_RANGE),
        kv_bytes_per_block=r.get(held.KV_BYTES_PER_BLOCK),
    )


def rank_rows(spans: list[SpanRecord]) -> list[RankRow]:
    """One row per worker, in (DP rank, rank) order (empty without worker spans)."""
    rows: dict[tuple[int, int], RankRow] = {}
    for s in spans:
        rank = s.resource.get(SpanAttributes.RANK)
        if s.process_kind != "worker" or rank is None:
            continue
        key = (s.resource.get(SpanAttributes.DP_RANK) or 0, rank)
        row = rows.get(key)
        if row is None:
            row = rows[key] = _new_row(s)
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
    # The pages: a rank's own tensor's count, else its engine's (the same on every rank).
    engine_blocks = {
        key[0]: row.kv_cache_shape[0] for key, row in rows.items() if row.kv_cache_shape
    }
    for (dp_rank, _), row in rows.items():
        own = row.kv_cache_shape[0] if row.kv_cache_shape else None
        row.num_blocks = own if own is not None else engine_blocks.get(dp_rank)
    return [rows[key] for key in sorted(rows)]


def _span_of(values: set[int], run: int = 3) -> str:
    """``0–29`` for a run (of at least ``run`` values), else the values
    themselves, shortened."""
    if not values:
        return "–"
    ordered = sorted(values)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) >= run:
        return f"{ordered[0]}–{ordered[-1]}"
    text = " ".join(map(str, ordered[:8]))
    return text + (" …" if len(ordered) > 8 else "")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _heads(heads: list[int], total: int | None) -> str:
    text = _span_of(set(heads), run=2)
    return text if total is None else f"{text} of {total}"


def _kv_heads(row: RankRow, rows: list[RankRow]) -> str:
    """Its KV heads, and the other ranks of its stage holding a copy of them."""
    text = _heads(row.kv_heads, row.total_kv_heads)
    if row.kv_head_replicas > 1:
        others = [
            f"W{r.rank}"
            for r in rows
            if r is not row
            and (r.dp_rank, r.pp_rank) == (row.dp_rank, row.pp_rank)
            and r.kv_heads == row.kv_heads
        ]
        text += f", copy on {' '.join(others)}" if others else ", copied"
    return text


def _layers(layer_range: list[int] | None, traced: set[int]) -> str:
    if layer_range is None:  # a trace from before the resource said so
        return _span_of(traced)
    start, end = layer_range
    return _span_of(set(range(start, end)), run=2)


def render_ranks(spans: list[SpanRecord]) -> Group | None:
    """The ranks table (and, at detail "full", their collectives), or None for
    a run without worker processes."""
    rows = rank_rows(spans)
    if not rows:
        return None
    show_dp = len({row.dp_rank for row in rows}) > 1
    headers = ["worker", "TP", "PP", *(["DP"] if show_dp else []), "layers", "q heads"]
    headers += ["KV heads", "KV pages", "pages written"]
    table = Table(box=None, pad_edge=False, header_style="bold")
    for header in headers:
        table.add_column(header, no_wrap=True)
    for row in rows:
        pages = "–"
        if row.num_blocks is not None:
            pages = f"{row.num_blocks}"
            if (kv_bytes := row.kv_cache_bytes) is not None:
                pages += f" · {_bytes(kv_bytes)}"
        cells: list[Text | str] = [
            Text(f"W{row.rank}", style="yellow"),
            str(row.tp_rank),
            str(row.pp_rank),
        ]
        if show_dp:
            cells.append(str(row.dp_rank))
        cells += [
            _layers(row.layer_range, row.layers),
            _heads(row.q_heads, row.total_q_heads) if row.q_heads else "–",
            _kv_heads(row, rows) if row.kv_heads else "–",
            pages,
            _span_of(row.pages),
        ]
        table.add_row(*cells)
    note = (
        "Heads and layers by index. Every rank holds every KV page, with its own KV "
        "heads only, in each of its layers: the bytes are its KV cache's."
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
