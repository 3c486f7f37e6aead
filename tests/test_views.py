"""The rich views draw what the step view says (they are what the book shows)."""

from __future__ import annotations

import io

from rich.console import Console

from tracevllm.tracing.exporters import SpanRecord
from tracevllm.views.step import _cells, render_step
from tracevllm.views.waterfall import render_waterfall

VIEW = {
    "step": 3,
    "token_budget": {"used": 14, "total": 32},
    "block_size": 16,
    "requests": [
        {
            "req_id": "0",
            "kind": "cached",
            "num_computed_tokens": 40,
            "num_scheduled_tokens": 1,
            "num_tokens": 41,
            "num_prompt_tokens": 37,
            "num_cached_tokens": 0,
            "block_ids": [1, 2, 3],
        },
        {
            "req_id": "1",
            "kind": "new",
            "num_computed_tokens": 16,
            "num_scheduled_tokens": 13,
            "num_tokens": 45,
            "num_prompt_tokens": 45,
            "num_cached_tokens": 16,
            "block_ids": [1, 4],
        },
    ],
    "preempted": ["2"],
    "finished": [],
    "kv": {"total": 20, "free": 16, "used": 4, "cached_free": 3},
    "prefix_cache": {"queries": 45, "hits": 16},
}


def _text(renderable: object) -> str:
    console = Console(width=140, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_step_view_shows_the_scheduler_output_blocks_and_pool() -> None:
    text = _text(render_step(VIEW, pid=1234))
    assert "EngineCore.step 3" in text and "pid 1234" in text
    assert "decode" in text and "prefill (chunk)" in text  # both phases in one step
    assert "14/32" in text
    assert "[1: 16/16] [2: 16/16] [3: 9/16]" in text  # 41 tokens over blocks of 16
    assert "[1: 16/16] [4: 13/16]" in text
    assert "preempted: 2" in text
    assert "in use 4" in text and "cached, evictable 3" in text and "free 13" in text
    assert "16/45 tokens hit" in text


def test_kv_bar_cells_are_proportional_and_never_hide_a_part() -> None:
    assert _cells([3, 2, 1450], 48) == [1, 1, 46]
    assert _cells([10, 10, 20], 40) == [10, 10, 20]
    assert sum(_cells([0, 0, 0], 40)) == 40


def _span(span_id: str, parent: str | None, name: str, pid: int, kind: str, t: int) -> SpanRecord:
    return SpanRecord(
        "t",
        span_id,
        parent,
        name,
        t,
        t + 10,
        {},
        {"process.pid": pid, "tracevllm.process_kind": kind},
    )


def test_waterfall_marks_the_boundary_crossing() -> None:
    spans = [
        _span("a", None, "llm_request", 1, "frontend", 0),
        _span("b", "a", "EngineCore.add_request", 2, "engine_core", 1),
        _span("c", "a", "LLMEngine.add_request", 1, "frontend", 2),
    ]
    lines = _text(render_waterfall(spans)).splitlines()
    crossed = [line for line in lines if "⇄" in line and line.startswith("│")]
    assert len(crossed) == 1 and "EngineCore.add_request" in crossed[0] and "EC 2" in crossed[0]
