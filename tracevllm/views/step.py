"""One engine step: SchedulerOutput, block tables (with a KV connector, where
each new prompt's blocks came from: views/block_origin.py), KV pool."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rich.bar import Bar
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tracevllm.views.block_origin import render_block_origin


def _phase(req: dict[str, Any]) -> str:
    """prefill / chunked prefill / decode, from the token counts."""
    computed, scheduled = req["num_computed_tokens"], req["num_scheduled_tokens"]
    if computed >= req["num_prompt_tokens"]:
        return "decode"
    if computed + scheduled < req["num_prompt_tokens"]:
        return "prefill (chunk)"
    return "prefill"


def with_grammar(view: dict[str, Any], allowed: dict[str, Any]) -> dict[str, Any]:
    """The step view with how many tokens each structured request's mask
    rows allowed (from the ``Scheduler.get_grammar_bitmask`` span of the
    same step): a list, one row per draft position and one more, or just
    one without drafts. (A bare count in traces written before rows were
    told apart.)"""
    for req in view["requests"]:
        counts = allowed.get(req["req_id"])
        if counts is not None:
            req["allowed_tokens"] = [counts] if isinstance(counts, int) else list(counts)
    return view


def with_spec(
    view: dict[str, Any],
    spec: dict[str, dict[str, Any]],
    decode: Callable[[list[int]], str] | None = None,
) -> dict[str, Any]:
    """The step view with what became of each request's drafts (from the
    ``Scheduler.update_from_output`` span of the same step). With ``decode``
    (a tokenizer's), each draft and the token after them carry their text,
    which the view shows in place of the ids."""
    for req in view["requests"]:
        if req["req_id"] in spec:
            req["spec"] = dict(spec[req["req_id"]])
            if decode is not None:
                req["spec"]["texts"] = [decode([t]) for t in req["spec"]["drafts"]]
                req["spec"]["next_text"] = decode([req["spec"]["next"]])
    return view


def _token(token: int, text: str | None) -> str:
    """A token as the view shows it: its text, quoted (so a leading space or
    a newline shows), or its id when no tokenizer was at hand."""
    return str(token) if text is None else json.dumps(text, ensure_ascii=False)


# --8<-- [start:drafts_line]
def _drafts_line(req: dict[str, Any]) -> Text:
    """``0  " the"✓ " old"✓ " man"✗ → " light" recovered · 83% kept``: each
    draft kept (✓) or rejected (✗, and those after it with it), then the token
    the target added after the kept ones, by vLLM's names: the **bonus** token
    if it kept them all, else the **recovered** token (the target's own pick
    at the first rejected position), then the share of this request's drafts
    kept so far. Where a stop ended the request inside the run, ``✂`` marks
    the cut and the tokens after it, which the request never got, are struck
    through."""
    spec = req.get("spec")
    line = Text(f"{req['req_id']}  ")
    if spec is None:  # drawn before the step ended
        return line.append(f"{len(req.get('spec_token_ids') or ())} drafts", style="dim")
    texts = spec.get("texts") or [None] * len(spec["drafts"])
    cut = spec.get("cut")
    kept_tokens = cut["kept"] if cut else len(spec["drafts"]) + 1  # of the emitted ones
    for i, (token, text) in enumerate(zip(spec["drafts"], texts)):
        if i == kept_tokens:
            line.append("✂ ", style="bold red")
        dropped = i >= kept_tokens
        kept = i < spec["accepted"]
        line.append(_token(token, text), style="dim strike" if dropped else "")
        line.append("✓ " if kept else "✗ ", style="green" if kept else "red")
    dropped = spec["accepted"] >= kept_tokens
    if spec["accepted"] == kept_tokens and spec["accepted"] == len(spec["drafts"]):
        line.append("✂ ", style="bold red")
    line.append("→ ")
    line.append(_token(spec["next"], spec.get("next_text")), style="dim strike" if dropped else "")
    line.append(" ")
    line.append(
        "bonus" if spec["bonus"] else "recovered", style="bold green" if spec["bonus"] else "yellow"
    )
    line.append(f" · {spec['rate']:.0%} kept", style="cyan")
    if cut:
        line.append(
            f" · {cut['finish_reason']} after {cut['kept']}",
            style="bold red",
        )
    return line


# --8<-- [end:drafts_line]


def _grammar_cell(req: dict[str, Any]) -> Text:
    """``json 12``: the kind of constraint and how many tokens its mask allowed
    this step; with drafts, each row's count in turn (``json 12 → 3 → 1``:
    the next position, then as it would stand after each draft); ``json –``
    for a row mid-prefill, which gets no mask."""
    if not req.get("structured"):
        return Text("")
    if "allowed_tokens" not in req:
        return Text(f"{req['structured']} –", style="dim magenta")
    counts = " → ".join(map(str, req["allowed_tokens"]))
    return Text(f"{req['structured']} {counts}", style="magenta")


def render_scheduler_output(view: dict[str, Any]) -> RenderableType:
    budget = view["token_budget"]
    table = Table(
        title=f"SchedulerOutput · step {view['step']}",
        title_justify="left",
        expand=False,
    )
    columns = ["request", "new/cached", "phase", "computed", "+scheduled", "tokens", "hit"]
    structured = any(req.get("structured") for req in view["requests"])
    if structured:
        columns.append("mask")
    for col in columns:
        left = col in ("request", "phase", "mask")
        table.add_column(col, justify="left" if left else "right")
    for req in view["requests"]:
        kind = req["kind"]
        style = {"new": "green", "resumed": "yellow", "cached": "cyan"}.get(kind, "")
        table.add_row(
            req["req_id"],
            Text(kind, style=style),
            _phase(req),
            str(req["num_computed_tokens"]),
            str(req["num_scheduled_tokens"]),
            str(req["num_tokens"]),
            str(req.get("num_cached_tokens") or ""),
            *([_grammar_cell(req)] if structured else []),
        )
    used, total = budget["used"], budget["total"]
    bar = Table.grid(padding=(0, 1))
    bar.add_row(
        Text("token budget"),
        Bar(size=total, begin=0, end=used, width=40, color="magenta"),
        Text(f"{used}/{total}"),
    )
    extra = []
    drafted = [req for req in view["requests"] if req.get("spec_token_ids") or req.get("spec")]
    if drafted:
        extra.append(Text("drafts (speculative decoding)", style="bold"))
        extra += [_drafts_line(req) for req in drafted]
    if view.get("preempted"):
        extra.append(Text(f"preempted: {', '.join(view['preempted'])}", style="bold red"))
    if view.get("finished"):
        extra.append(Text(f"finished since last step: {', '.join(view['finished'])}"))
    return Group(table, bar, *extra)


def _block_cells(block_ids: list[int], filled: int, block_size: int) -> Text:
    """``[id: tokens/block_size]`` per block; a run of null blocks (id 0: blocks a
    sliding window freed) as one ``[freed x n]``."""
    cells = Text()
    num_freed = 0
    for i, block_id in enumerate(block_ids):
        if block_id == 0:
            num_freed += 1
            continue
        if num_freed:
            cells.append(f"[freed x {num_freed}]", style="dim strike")
            cells.append(" ")
            num_freed = 0
        n = max(0, min(block_size, filled - i * block_size))
        style = "green" if n == block_size else ("yellow" if n else "dim")
        cells.append(f"[{block_id}: {n}/{block_size}]", style=style)
        cells.append(" ")
    if num_freed:
        cells.append(f"[freed x {num_freed}]", style="dim strike")
    return cells


def _group_name(group: dict[str, Any]) -> str:
    window = group.get("sliding_window")
    return f"sliding window {window}" if window else "full attention"


def render_block_tables(view: dict[str, Any]) -> RenderableType:
    """Each request's block ids, and how full each block is after this step.

    With several KV cache groups, a row per group; blocks a sliding window
    freed are drawn as ``[freed x n]``, and each such group's running count
    goes under the table.
    """
    block_size = view["block_size"]
    groups = view.get("kv", {}).get("groups") or []
    table = Table(title="Block tables", title_justify="left", show_header=True)
    table.add_column("request")
    table.add_column("blocks (id: tokens/block_size)")
    for req in view["requests"]:
        filled = req["num_computed_tokens"] + req["num_scheduled_tokens"]
        per_group = req.get("group_block_ids") or [req["block_ids"]]
        for g, block_ids in enumerate(per_group):
            label = req["req_id"] if g == 0 else ""
            if len(per_group) > 1:
                label = f"{label} {_group_name(groups[g]) if g < len(groups) else g}".strip()
            table.add_row(label, _block_cells(block_ids, filled, block_size))
    freed = [
        f"{_group_name(g)}: {g['freed_by_window']} blocks freed so far"
        for g in groups
        if g.get("sliding_window")
    ]
    if freed:
        table.caption = "; ".join(freed)
        table.caption_justify = "left"
    return table


def _cells(counts: list[int], width: int) -> list[int]:
    """Split ``width`` cells in proportion to ``counts``, at least one for any non-zero."""
    total = max(sum(counts), 1)
    cells = [max(1, round(width * c / total)) if c else 0 for c in counts]
    # Give or take the rounding error from the largest part.
    cells[cells.index(max(cells))] += width - sum(cells)
    return cells


def render_kv_pool(view: dict[str, Any], width: int = 48) -> RenderableType:
    """One bar for the pool: in use | cached but evictable | free."""
    kv = view["kv"]
    in_use, cached = kv["used"], kv["cached_free"]
    free = kv["free"] - cached
    bar = Text()
    for n, style in zip(_cells([in_use, cached, free], width), ("red", "yellow", "green")):
        bar.append("█" * n, style=style)
    grid = Table.grid(padding=(0, 1))
    grid.add_row(Text("KV pool"), bar)
    grid.add_row(
        Text(""),
        Text.assemble(
            (f"in use {in_use}", "red"),
            "  ",
            (f"cached, evictable {cached}", "yellow"),
            "  ",
            (f"free {free}", "green"),
            f"  (of {kv['total']} blocks)",
        ),
    )
    pc = view.get("prefix_cache") or {}
    if pc.get("queries"):
        grid.add_row(Text("prefix cache"), Text(f"{pc['hits']}/{pc['queries']} tokens hit"))
    return grid


def render_step(view: dict[str, Any], pid: int | None = None) -> RenderableType:
    where = f" · engine_core pid {pid}" if pid else ""
    parts = [render_scheduler_output(view), render_block_tables(view)]
    if (origin := render_block_origin(view)) is not None:
        parts.append(origin)
    return Panel(
        Group(*parts, render_kv_pool(view)),
        title=f"EngineCore.step {view['step']}{where}",
        title_align="left",
        border_style="blue",
    )
