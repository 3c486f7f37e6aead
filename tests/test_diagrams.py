"""The book's figures show what they say: no label cut at a picture's edge, no
span cut from a waterfall without a line that says how many."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tracevllm.tracing.exporters import SpanRecord
from tracevllm.views.waterfall import render_waterfall

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "docs" / "assets" / "recorded"
sys.path.insert(0, str(ROOT / "docs"))

import diagrams  # noqa: E402  (docs/diagrams.py)

# A label as docs/diagrams.py writes it.
TEXT = re.compile(
    r'<text x="(?P<x>[\d.-]+)" y="(?P<y>[\d.-]+)" fill="[^"]*" text-anchor="(?P<anchor>\w+)" '
    r'style="(?P<style>[^"]*)"[^>]*>(?P<s>[^<]*)</text>'
)
SIZE = re.compile(r'<svg [^>]*width="(?P<w>\d+)" height="(?P<h>\d+)"')


def _unescape(s: str) -> str:
    return s.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")


def _labels_outside(svg: str) -> list[str]:
    size = SIZE.search(svg)
    assert size is not None
    width, height = int(size["w"]), int(size["h"])
    out = []
    for m in TEXT.finditer(svg):
        s = _unescape(m["s"]).replace("&#x27;", "'")
        left, right = diagrams.text_extent(float(m["x"]), s, m["anchor"], "monospace" in m["style"])
        if left < 0 or right > width or float(m["y"]) > height:
            out.append(f"{s!r}: x {left:.0f}..{right:.0f} of {width}")
    return out


def _drawn_by_diagrams() -> list[Path]:
    return [p for p in sorted(RECORDED.glob("*.svg")) if TEXT.search(p.read_text())]


def test_the_recorded_diagrams_keep_every_label_inside() -> None:
    """Every committed diagram of docs/diagrams.py (the free queue's
    "ref_cnt 2 → 1" was cut to "ref_cr")."""
    drawn = _drawn_by_diagrams()
    assert len(drawn) >= 5, drawn
    problems = {p.name: _labels_outside(p.read_text()) for p in drawn}
    assert not {name: bad for name, bad in problems.items() if bad}


def test_a_label_past_the_edge_fails_the_drawing() -> None:
    svg = diagrams.Svg(100, 40, "narrow")
    svg.text(10, 20, "a label much longer than one hundred pixels")
    with pytest.raises(diagrams.LabelOutside, match="narrow"):
        svg.render()


def test_the_free_queue_wraps_a_long_note() -> None:
    note = "the shared block stays with request 0, which holds it: ref_cnt 2 → 1"
    svg = diagrams.free_queue([("step 29", {"0": [1, 2, 3, 4]}, [(6, True), (5, True)], note)], "q")
    assert not _labels_outside(svg)
    assert "ref_cnt 2 → 1" in svg


# ------------------------------------------------------------- waterfall
def _span(i: int, parent: int | None, name: str) -> SpanRecord:
    return SpanRecord(
        "t",
        str(i),
        None if parent is None else str(parent),
        name,
        i * 1_000_000,
        (i + 5) * 1_000_000,
        {},
        {"process.pid": 1, "tracevllm.process_kind": "engine_core"},
    )


def _text(renderable: object, width: int = 100) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _steps(n: int, inside: int) -> list[SpanRecord]:
    """A request with ``n`` steps, ``inside`` spans under each."""
    spans = [_span(0, None, "llm_request")]
    for _ in range(n):
        step = len(spans)
        spans.append(_span(step, 0, "EngineCore.step"))
        spans += [_span(step + 1 + j, step, f"Child.c{j}") for j in range(inside)]
    return spans


def test_a_waterfall_cut_at_max_rows_says_how_many_rows_it_left_out() -> None:
    spans = _steps(3, 4)  # 1 + 3 * 5 = 16 rows
    text = _text(render_waterfall(spans, max_rows=10))
    assert "… 7 more rows, past max_rows 10" in text
    rows = [line for line in text.splitlines()[3:] if line.strip()]
    assert len(rows) == 10
    # Not cut: no such line.
    assert "more rows" not in _text(render_waterfall(spans, max_rows=16))


def test_folded_siblings_and_collapsed_spans_say_how_many() -> None:
    spans = _steps(5, 2)
    text = _text(render_waterfall(spans))
    assert text.count("EngineCore.step") == 4  # three, then the fold line
    assert "… 2 more EngineCore.step" in text
    # In a narrow terminal names lose their class, not the fold line its name.
    narrow = _text(render_waterfall(_steps(5, 40)), 60)
    assert "… 2 more EngineCore.step" in narrow and "… 37 more .c" not in narrow
    text = _text(render_waterfall(spans, max_same_name=5, collapse=frozenset({"EngineCore.step"})))
    assert text.count("EngineCore.step") == 5
    assert text.count("… 2 spans inside") == 5
    assert "Child.c0" not in text


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_render_waterfall_refuses_a_bad_max_rows(bad: object) -> None:
    with pytest.raises(ValueError, match="max_rows"):
        render_waterfall(_steps(1, 1), max_rows=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------ the spec view
def _spec_view(spec: dict[str, object]) -> dict[str, object]:
    view = {
        "step": 5,
        "token_budget": {"used": 6, "total": 64},
        "block_size": 16,
        "requests": [
            {
                "req_id": "0",
                "kind": "cached",
                "num_computed_tokens": 77,
                "num_scheduled_tokens": 5,
                "num_tokens": 78,
                "num_prompt_tokens": 60,
                "block_ids": [1, 2, 3, 4, 5, 8],
            }
        ],
        "kv": {"total": 20, "free": 12, "used": 8, "cached_free": 0},
    }
    from tracevllm.views.step import with_spec

    words = {897: " every", 9053: " evening", 30: ".", 909: " He", 28: ",", 2: "<eos>"}
    return with_spec(view, {"0": spec}, lambda ids: "".join(words[t] for t in ids))


def test_the_spec_view_shows_drafts_as_text_and_names_the_recovered_token() -> None:
    from tracevllm.views.step import render_step

    spec = {"drafts": [897, 9053, 30, 909], "accepted": 2, "next": 28, "bonus": False}
    text = _text(render_step(_spec_view({**spec, "rate": 0.75})))
    line = next(line for line in text.splitlines() if "✓" in line)
    assert '" every"✓ " evening"✓ "."✗ " He"✗ → "," recovered · 75% kept' in line
    assert "✂" not in line


def test_the_spec_view_shows_a_stop_inside_the_accepted_run_as_a_cut() -> None:
    from tracevllm.views.step import render_step

    spec = {"drafts": [897, 2, 30, 909], "accepted": 4, "next": 28, "bonus": True, "rate": 1.0}
    cut = {**spec, "cut": {"kept": 2, "finish_reason": "stop"}}
    text = _text(render_step(_spec_view(cut)), 160)
    line = next(line for line in text.splitlines() if "✓" in line)
    assert '" every"✓ "<eos>"✓ ✂ "."✓ " He"✓ → "," bonus' in line
    assert line.rstrip(" │").endswith("100% kept · stop after 2")
