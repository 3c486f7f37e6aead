"""Record the structured-outputs chapter's views from a real run.

``docs/record_assets.py`` calls ``run()`` and ``draw()`` with the book's other
runs; ``python docs/record_structured.py`` re-records this one alone (and
``--draw-only`` redraws it), updating the ``structured`` entry of
``facts.json`` and leaving the other recordings as they are.

The run: one process, a 16-token budget, two chat prompts added before the
first step: a JSON-schema request (compact JSON, greedy) and a plain one. The
budget cuts the structured request's prompt into chunks, so the views show a
structured row mid-prefill (no mask), then one mask per step, and the plain
row beside it untouched.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs"))

import record_assets as assets  # noqa: E402
from recording import external, step_view, steps_of  # noqa: E402

from tests import structured_cases  # noqa: E402
from tracevllm.tracing.exporters import SpanRecord  # noqa: E402
from tracevllm.views.step import render_step, with_grammar  # noqa: E402
from tracevllm.views.waterfall import render_waterfall  # noqa: E402

NAME = "structured"
SCHEMA = structured_cases.FLAT  # name, age, city; the tests' first schema
PROMPTS = [
    "Describe a person who lives in Paris as JSON: their name, their age and their city.",
    "What is the capital of France?",
]
ENGINE = {"max_num_batched_tokens": 16}
GRAMMAR_SPAN = "Scheduler.get_grammar_bitmask"


def run() -> None:
    from tracevllm import LLM, SamplingParams
    from tracevllm.sampling_params import StructuredOutputsParams

    out = assets.fresh_run_dir(NAME)
    print(f"# {NAME}: a JSON schema and a plain prompt, {ENGINE}", flush=True)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so),
        SamplingParams(temperature=0.0, max_tokens=8),
    ]
    with LLM(enable_multiprocessing=False, trace_detail="request", trace_dir=out, **ENGINE) as llm:
        conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    for o in outputs:
        print(f"  {o.request_id}: {o.outputs[0].text!r}")


def _mask_of(step: dict[str, SpanRecord]) -> dict[str, int]:
    """req id (the caller's) -> tokens its mask allowed, this step (its one
    row: this run has no drafts)."""
    span = step.get(GRAMMAR_SPAN)
    if span is None:
        return {}
    allowed = json.loads(span.attributes["tracevllm.view.grammar"])
    return {external(req_id): n if isinstance(n, int) else n[0] for req_id, n in allowed.items()}


def _subtree(spans: list[SpanRecord], top: SpanRecord, depth: int) -> list[SpanRecord]:
    """``top`` and its descendants down to ``depth`` levels below it."""
    shown, level = [top], [top]
    for _ in range(depth):
        ids = {s.span_id for s in level}
        level = [s for s in spans if s.parent_span_id in ids]
        shown += level
    return shown


def draw() -> dict[str, Any]:
    from transformers import AutoTokenizer

    from tracevllm.model_executor.model_loader import resolve_model

    spans = assets.load(NAME)
    steps = steps_of(spans)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    views = {i: with_grammar(step_view(steps[i]), _mask_of(steps[i])) for i in sorted(steps)}
    # The structured request is "0": its first step (a prefill chunk, no
    # mask) and its first masked step.
    chunk = next(i for i, v in views.items() if any(r["req_id"] == "0" for r in v["requests"]))
    masked = next(i for i in sorted(steps) if "0" in _mask_of(steps[i]))
    assets.save_svg(f"{NAME}-step-chunk.svg", render_step(views[chunk]), f"step {chunk}")
    assets.save_svg(f"{NAME}-step-masked.svg", render_step(views[masked]), f"step {masked}")

    # Step by step: what the mask allowed, and the token the model took.
    rows, table = [], ["| step | tokens allowed | token sampled |", "|---:|---:|---|"]
    for i in sorted(steps):
        allowed = _mask_of(steps[i]).get("0")
        if allowed is None:
            continue
        sampled = steps[i]["ModelRunner.sample_tokens"].attributes
        row = [external(r) for r in sampled["tracevllm.req_ids"]].index("0")
        token_id = sampled["tracevllm.sampled_token_ids"][row]
        text = tokenizer.decode([token_id])
        rows.append({"step": i, "allowed": allowed, "token_id": token_id, "text": text})
        shown = "EOS" if token_id == tokenizer.eos_token_id else f"`{text}`"
        table.append(f"| {i} | {allowed} | {shown} |")
    assets.write_text(f"{NAME}-masks.md", "\n".join(table) + "\n")

    # The structured request's span and two levels below it: its entry, its
    # compilation on the thread pool, and the steps it joined.
    request = next(
        s
        for s in spans
        if s.name == "llm_request" and external(s.attributes["gen_ai.request.id"]) == "0"
    )
    shown = _subtree(spans, request, depth=2)
    assets.save_svg(f"{NAME}-waterfall.svg", render_waterfall(shown), "the JSON request", 80)
    first = next(r for r in views[chunk]["requests"] if r["req_id"] == "0")
    compile_span = next(s for s in shown if s.name == "StructuredOutputManager._create_grammar")
    text = "".join(r["text"] for r in rows if r["token_id"] != tokenizer.eos_token_id)
    return {
        "chunk_step": chunk,
        "masked_step": masked,
        "chunk_tokens": first["num_scheduled_tokens"],
        "chunk_cached": first["num_cached_tokens"],
        "first_allowed": rows[0]["allowed"],
        "first_token": rows[0]["text"],
        "min_allowed": min(r["allowed"] for r in rows),
        "max_allowed": max(r["allowed"] for r in rows),
        "num_masked_steps": len(rows),
        "last_allowed": rows[-1]["allowed"],
        "output": text,
        "compile_joined": compile_span.attributes["tracevllm.structured_output.joined"],
        "vocab_size": tokenizer.vocab_size,
    }


def main() -> None:
    assets.rerecord_alone(__doc__, NAME, run, draw)


if __name__ == "__main__":
    main()
