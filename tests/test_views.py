"""The rich views draw what the step view says (they are what the book shows)."""

from __future__ import annotations

import io
import re
from typing import Any

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
    crossed = [line for line in lines if "⇄ " in line and "EngineCore" in line]
    assert len(crossed) == 1 and "EngineCore.add_request" in crossed[0] and "EC 2" in crossed[0]


def _run(pids: tuple[int, int] = (123456, 123999)) -> list[SpanRecord]:
    """A request's span tree, two processes, six-digit pids, 900 ms."""
    fe, ec = pids

    def span(i: str, parent: str | None, name: str, kind: str, t: int, ms: int) -> SpanRecord:
        return SpanRecord(
            "t",
            i,
            parent,
            name,
            t * 1_000_000,
            (t + ms) * 1_000_000,
            {},
            {"process.pid": fe if kind == "frontend" else ec, "tracevllm.process_kind": kind},
        )

    return [
        span("a", None, "LLM.generate", "frontend", 0, 900),
        span("b", "a", "llm_request", "frontend", 1, 890),
        span("c", "b", "LLMEngine.add_request", "frontend", 1, 5),
        span("d", "c", "InputProcessor.process_inputs", "frontend", 1, 3),
        span("e", "b", "EngineCore.add_request", "engine_core", 7, 1),
        span("f", "b", "EngineCore.step", "engine_core", 8, 300),
        span("g", "f", "ModelRunner.execute_model", "engine_core", 9, 250),
        span("h", "g", "ModelRunner._prepare_inputs", "engine_core", 9, 2),
        span("i", "g", "LlamaForCausalLM.forward", "engine_core", 12, 240),
        span("j", "i", "reshape_and_cache_flash", "engine_core", 13, 1),
    ]


def _lines(width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render_waterfall(_run()))
    return console.export_text().splitlines()


def test_waterfall_is_readable_at_80_columns() -> None:
    """The columns give way before the timeline does: at 80 columns every span
    keeps its whole name, its process and its duration, and its bar has room."""
    lines = _lines(80)
    assert max(len(line) for line in lines) <= 80
    for name in ("LLM.generate", "InputProcessor.process_inputs", "reshape_and_cache_flash"):
        assert any(name in line for line in lines), name
    assert "…" not in "\n".join(lines)  # nothing cut
    forward = next(line for line in lines if "LlamaForCausalLM.forward" in line)
    assert " EC " in forward and "240.00" in forward
    whole = next(line for line in lines if line.startswith("LLM.generate"))
    assert whole.count("█") >= 30  # the 900 ms root spans the whole timeline
    assert "FE pid 123456" in lines[1] + lines[2] and "EC pid 123999" in lines[1] + lines[2]


def test_a_wide_terminal_shows_pids_and_start_times() -> None:
    lines = _lines(150)
    forward = next(line for line in lines if "LlamaForCausalLM.forward" in line)
    assert "EC 123999" in forward and "12.0" in forward
    assert "start ms" in "\n".join(lines)
    assert max(len(line) for line in lines) <= 150


def test_a_narrow_terminal_shortens_names_before_cutting_them() -> None:
    """A child of the same class drops the class (``._prepare_inputs``);
    names are cut only past that."""
    lines = _lines(70)
    assert max(len(line) for line in lines) <= 70
    text = "\n".join(lines)
    assert "._prepare_inputs" in text and "ModelRunner._prepare_inputs" not in text
    assert "ModelRunner.execute_model" in text  # its parent is another class
    assert "…" not in text
    cut = _lines(50)
    assert max(len(line) for line in cut) <= 50 and "…" in "\n".join(cut)


# Two structured requests with drafts: digits, whose prompt is full of
# digits (n-gram drafts at almost every step), then letters. A different
# number of tokens fits each, so a count read from the other's rows shows.
DRAFTED = [
    ("Digits: 0123456789 0123456789 0123456789 0123456789", "[0-9]{14}"),
    ("Some letters: abcde abcde abcde", "[a-e]{14}"),
]


def test_grammar_view_gives_each_request_its_own_rows_with_drafts(
    tiny_model_dir: str, tmp_path: object
) -> None:
    """With n-gram drafts a structured request has a mask row per draft
    position and one more. The grammar view gives each request the counts
    of its own rows: each equals what a fresh xgrammar matcher allows after
    the request's tokens before the step and the drafts before that row."""
    import json

    import numpy as np
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from tracevllm import LLM, SamplingParams
    from tracevllm.sampling_params import StructuredOutputsParams
    from tracevllm.tracing.attributes import SpanAttributes
    from tracevllm.tracing.exporters import read_spans_jsonl
    from tracevllm.views.report import GRAMMAR_SPAN, STEP_SPAN, render_report

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r)
        )
        for _, r in DRAFTED
    ]
    with LLM(
        model=tiny_model_dir,
        enable_multiprocessing=False,
        speculative_config=spec,
        trace_detail="request",
        trace_dir=str(tmp_path),
    ) as llm:
        outputs = llm.generate([p for p, _ in DRAFTED], params, use_tqdm=False)
        vocab_size = llm.llm_engine.vllm_config.model_config.vocab_size
    spans = read_spans_jsonl(f"{tmp_path}/spans.jsonl")

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    )
    # A request of the engine's, by its prompt's length: its grammar and tokens.
    requests = {
        len(out.prompt_token_ids): (compiler.compile_regex(regex), out.outputs[0].token_ids)
        for out, (_, regex) in zip(outputs, DRAFTED, strict=True)
    }
    assert len(requests) == 2

    def allowed_rows(grammar: Any, tokens: list[int], drafts: list[int]) -> list[int]:
        matcher = xgr.GrammarMatcher(grammar)
        assert all(matcher.accept_token(t) for t in tokens)
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        counts = []
        for draft in [*drafts, None]:
            if matcher.is_terminated():  # the engine's full row: nothing to forbid
                counts.append(vocab_size)
            else:
                matcher.fill_next_token_bitmask(bitmask, 0)
                bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
                counts.append(int(bits[:vocab_size].sum()))
            if draft is not None:
                assert matcher.accept_token(draft)
        return counts

    views = {
        s.attributes[SpanAttributes.STEP_ID]: json.loads(s.attributes[SpanAttributes.STEP_VIEW])
        for s in spans
        if s.name == STEP_SPAN
    }
    masks = [
        s
        for s in spans
        if s.name == GRAMMAR_SPAN and s.attributes.get("tracevllm.structured_output.req_ids")
    ]
    assert masks
    drafted_behind = 0  # steps where the second request's rows follow a drafted one's
    for span in masks:
        allowed = json.loads(span.attributes[SpanAttributes.GRAMMAR_VIEW])
        rows = {r["req_id"]: r for r in views[span.attributes[SpanAttributes.STEP_ID]]["requests"]}
        for req_id, counts in allowed.items():
            row = rows[req_id]
            grammar, output = requests[row["num_prompt_tokens"]]
            before = output[: row["num_tokens"] - row["num_prompt_tokens"]]
            assert counts == allowed_rows(grammar, before, row["spec_token_ids"]), req_id
        first = next(iter(allowed.values()))
        drafted_behind += len(allowed) == 2 and len(first) > 1
        # The flat attributes say the same: rows per request, then each row's count.
        assert span.attributes["tracevllm.structured_output.num_rows"] == [
            len(c) for c in allowed.values()
        ]
        assert span.attributes["tracevllm.structured_output.num_allowed_tokens"] == [
            n for c in allowed.values() for n in c
        ]
    assert drafted_behind > 0
    # The step view shows each row's count in turn.
    console = Console(record=True, width=200, file=io.StringIO())
    render_report(spans, console)
    assert re.search(r"regex 10 → 10( → \d+)*", console.export_text())
