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

import diagrams_cache  # noqa: E402  (docs/, beside this file)
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
    compile_span = next(s for s in shown if s.name == "StructuredOutputManager._create_grammar")
    # The steps that ran while the grammar compiled belong to request 1's
    # trace (a step joins the oldest running request's): drawn beside the
    # JSON request's spans, one line each, they show the overlap.
    during = [
        s
        for s in spans
        if s.name == "EngineCore.step"
        and s.start_ns < compile_span.end_ns
        and s.end_ns > compile_span.start_ns
        and s not in shown
    ]
    waterfall = render_waterfall(shown + during)
    assets.save_svg(f"{NAME}-waterfall.svg", waterfall, "the JSON request", 80)
    first = next(r for r in views[chunk]["requests"] if r["req_id"] == "0")
    masking = _masking_cost(spans, steps)
    text = "".join(r["text"] for r in rows if r["token_id"] != tokenizer.eos_token_id)
    packing = draw_bitmask(tokenizer, rows)
    return {
        "packing": packing,
        "masking": masking,
        "compile_ms": round(compile_span.duration_ms),
        "steps_during_compile": len(during),
        "first_step_during_compile": min(
            int(steps_id) for steps_id, st in steps.items() if st["EngineCore.step"] in during
        )
        if during
        else None,
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


def _masking_cost(spans: list[SpanRecord], steps: Any) -> dict[str, Any]:
    """ModelRunner.sample_tokens less its Sampler.forward, per step: the
    bitmask's application (apply_grammar_bitmask) where the step had a mask
    row, next to nothing where it had none. Medians in ms, this recording's."""
    kids: dict[str, list[SpanRecord]] = {}
    for s in spans:
        kids.setdefault(s.parent_span_id or "", []).append(s)
    masked, plain = [], []
    for i in sorted(steps):
        sample = steps[i].get("ModelRunner.sample_tokens")
        if sample is None:
            continue
        sampler = sum(
            k.duration_ms for k in kids.get(sample.span_id, []) if k.name == "Sampler.forward"
        )
        (masked if _mask_of(steps[i]) else plain).append(sample.duration_ms - sampler)

    def median(xs: list[float]) -> float:
        return round(sorted(xs)[len(xs) // 2], 2)

    return {
        "masked_steps": len(masked),
        "masked_median_ms": median(masked),
        "masked_max_ms": round(max(masked), 1),
        "plain_steps": len(plain),
        "plain_median_ms": median(plain),
    }


def draw_bitmask(tokenizer: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON request's bitmask as the engine fills it: its xgrammar backend
    compiles the recorded run's schema, the matcher is walked through the
    tokens the run sampled, and the rows of the first masked step and of the
    widest one are read back (their counts checked against the recording)."""
    import torch

    from tracevllm.structured_output.backend_types import StructuredOutputOptions
    from tracevllm.structured_output.backend_xgrammar import XgrammarBackend

    vocab_size = tokenizer.vocab_size
    backend = XgrammarBackend(tokenizer, vocab_size)
    grammar = backend.compile_grammar(
        StructuredOutputOptions.JSON, json.dumps(SCHEMA), any_whitespace=False
    )
    widest = max(range(len(rows)), key=lambda k: rows[k]["allowed"])
    masks = {}
    for k, row in enumerate(rows):
        if k in (0, widest):
            bitmask = backend.allocate_token_bitmask(1)
            grammar.fill_bitmask(bitmask, 0)
            masks[k] = bitmask[0].clone()  # [ceil(vocab_size / 32)], int32
            words = masks[k].to(torch.int64) & 0xFFFFFFFF
            allowed = sum(bin(int(w)).count("1") for w in words)
            assert allowed == row["allowed"], (k, allowed, row["allowed"])
        if k == widest:
            break
        assert grammar.accept_tokens("0", [row["token_id"]])
    first = masks[0]
    allowed_first = [t for t in range(vocab_size) if (int(first[t // 32]) >> (t % 32)) & 1]
    wide = masks[widest]
    # A word of the wide row with its sign bit set and some bit clear.
    mixed = [w for w in range(len(wide)) if int(wide[w]) < 0 and int(wide[w]) != -1]
    word = mixed[0]
    clear = [32 * word + b for b in range(32) if not (int(wide[word]) >> b) & 1]
    text = {t: json.dumps(tokenizer.decode([t]), ensure_ascii=False) for t in allowed_first + clear}
    num_words = len(first)
    counts = {
        "all": int((wide == -1).sum()),
        "none": int((wide == 0).sum()),
    }
    panels = [
        (
            f"step {rows[0]['step']}, the first masked step: {rows[0]['allowed']} tokens allowed",
            allowed_first[0] // 32,
            int(first[allowed_first[0] // 32]),
            [(t, text[t]) for t in allowed_first],
        )
    ]
    if allowed_first[-1] // 32 != allowed_first[0] // 32:
        panels.append(
            (
                "…and the word of the other",
                allowed_first[-1] // 32,
                int(first[allowed_first[-1] // 32]),
                [(t, text[t]) for t in allowed_first],
            )
        )
    panels.append(
        (
            f"step {rows[widest]['step']}, inside a string: {rows[widest]['allowed']} allowed",
            word,
            int(wide[word]),
            [(t, text[t]) for t in clear[:1]],
        )
    )
    summary = [
        f"{vocab_size} tokens → {num_words} int32 words per row (token t: word t // 32, "
        "bit t % 32, least significant first)",
        f"at step {rows[widest]['step']}: {counts['all']} words are −1 (all 32 allowed), "
        f"{counts['none']} are 0, the rest mixed",
    ]
    assets.write_text(f"{NAME}-bitmask.svg", diagrams_cache.bitmask_words(panels, summary))
    return {
        "num_words": num_words,
        "first_tokens": allowed_first,
        "first_texts": [tokenizer.decode([t]) for t in allowed_first],
        "first_words": [t // 32 for t in allowed_first],
        "first_bits": [t % 32 for t in allowed_first],
        "wide_step": rows[widest]["step"],
        "wide_word": word,
        "wide_value": int(wide[word]),
        "wide_clear": clear,
        "wide_clear_texts": [tokenizer.decode([t]) for t in clear],
        "wide_all_words": counts["all"],
    }


def main() -> None:
    assets.rerecord_alone(__doc__, NAME, run, draw)


if __name__ == "__main__":
    main()
