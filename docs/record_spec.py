"""Record the speculative-decoding chapter's views from a real run.

``docs/record_assets.py`` calls ``run()`` and ``draw()`` with the book's other
runs; ``python docs/record_spec.py`` re-records this one alone (and
``--draw-only`` redraws it), updating the ``spec`` entry of ``facts.json``
and leaving the other recordings as they are.

The run: one process, n-gram drafts (k = 4, lookup 2-4), two chat prompts
added before the first step: one that asks the model to repeat a sentence
(its drafts come from the prompt and are mostly kept) and a plain question
(few drafts), greedy. The views show both requests in the same steps, the
drafts kept and rejected, and the per-request acceptance so far.
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

from tracevllm.tracing.exporters import SpanRecord  # noqa: E402
from tracevllm.views.step import render_step, with_spec  # noqa: E402
from tracevllm.views.waterfall import render_waterfall  # noqa: E402

NAME = "spec"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}  # fmt: skip
PROMPTS = [
    "Repeat this passage exactly: The old lighthouse keeper climbs the stairs every"
    " evening. He lights the lamp, winds the clock and writes one line in the logbook"
    " before the ships come past the rocks.",
    "What is the capital of France?",
]
UPDATE_SPAN = "Scheduler.update_from_output"


def run() -> None:
    from tracevllm import LLM, SamplingParams

    out = assets.fresh_run_dir(NAME)
    print(f"# {NAME}: a copy prompt and a question, {SPEC}", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    with LLM(
        enable_multiprocessing=False, trace_detail="request", trace_dir=out, speculative_config=SPEC
    ) as llm:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False
        )
    for o in outputs:
        print(f"  {o.request_id}: {o.outputs[0].text!r}")


def spec_of(step: dict[str, SpanRecord]) -> dict[str, dict[str, Any]]:
    """req id (the caller's) -> what became of its drafts, this step."""
    span = step.get(UPDATE_SPAN)
    if span is None or "tracevllm.view.spec" not in span.attributes:
        return {}
    spec = json.loads(span.attributes["tracevllm.view.spec"])
    return {external(req_id): s for req_id, s in spec.items()}


def draw() -> dict[str, Any]:
    from transformers import AutoTokenizer

    from tracevllm.model_executor.model_loader import resolve_model

    spans = assets.load(NAME)
    steps = steps_of(spans)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    specs = {i: spec_of(steps[i]) for i in sorted(steps)}
    views = {i: with_spec(step_view(steps[i]), specs[i]) for i in sorted(steps)}
    # The first step with drafts, and the first where a request had a draft
    # rejected (the copy request's if it had one).
    first = next(i for i in sorted(steps) if specs[i])
    with_rejection = [
        (i, r) for i in sorted(steps) for r, s in sorted(specs[i].items()) if not s["bonus"]
    ]
    rejected, rejected_req = min(with_rejection, key=lambda ir: (ir[1] != "0", ir[0]))
    assets.save_svg(f"{NAME}-step-first.svg", render_step(views[first]), f"step {first}")
    assets.save_svg(f"{NAME}-step-rejected.svg", render_step(views[rejected]), f"step {rejected}")

    # Request 0 step by step: its drafts, which were kept, what it emitted.
    table = ["| step | drafts | kept | emitted |", "|---:|---|---:|---|"]
    rows = []
    for i in sorted(steps):
        s = specs[i].get("0")
        if s is None:
            continue
        drafts = " ".join(f"`{tokenizer.decode([t])}`" for t in s["drafts"])
        kept = tokenizer.decode(s["drafts"][: s["accepted"]] + [s["next"]])
        table.append(f"| {i} | {drafts} | {s['accepted']} of {len(s['drafts'])} | `{kept}` |")
        rows.append(s)
    assets.write_text(f"{NAME}-drafts.md", "\n".join(table) + "\n")

    # One step with drafts, three levels deep: the proposer and the rejection
    # sampler in their places.
    step_span = steps[rejected]["EngineCore.step"]
    shown, level = [step_span], [step_span]
    for _ in range(3):
        ids = {s.span_id for s in level}
        level = [s for s in spans if s.parent_span_id in ids and s.name != "unified_attention"]
        shown += level
    assets.save_svg(f"{NAME}-waterfall.svg", render_waterfall(shown), f"step {rejected}", 80)

    requests = {
        external(s.attributes["gen_ai.request.id"]): s.attributes
        for s in spans
        if s.name == "llm_request"
    }
    copy = requests["0"]
    num_steps = len(steps)
    drafted = copy["tracevllm.spec_decode.num_draft_tokens"]
    accepted = copy["tracevllm.spec_decode.num_accepted_tokens"]
    steps_with_drafts = copy["tracevllm.spec_decode.num_drafts"]
    return {
        "k": SPEC["num_speculative_tokens"],
        "first_step": first,
        "rejected_step": rejected,
        "rejected_req": int(rejected_req),
        "rejected_kept": specs[rejected][rejected_req]["accepted"],
        "rejected_drafts": len(specs[rejected][rejected_req]["drafts"]),
        "num_steps": num_steps,
        "copy_tokens": copy["gen_ai.usage.output_tokens"],
        "copy_drafts": drafted,
        "copy_accepted": accepted,
        "copy_draft_steps": steps_with_drafts,
        "copy_mean_acceptance_length": round(1 + accepted / steps_with_drafts, 2),
        "copy_text": copy["tracevllm.completion.text"],
        "question_tokens": requests["1"]["gen_ai.usage.output_tokens"],
        "question_drafts": requests["1"].get("tracevllm.spec_decode.num_draft_tokens", 0),
        "max_kept": max(r["accepted"] for r in rows),
    }


def main() -> None:
    assets.rerecord_alone(__doc__, NAME, run, draw)


if __name__ == "__main__":
    main()
