"""Record the speculative-decoding chapter's views from a real run.

``docs/record_assets.py`` calls ``run()`` and ``draw()`` with the book's other
runs; ``python docs/record_spec.py`` re-records this one alone (and
``--draw-only`` redraws it), updating the ``spec`` entry of ``facts.json``
and leaving the other recordings as they are.

The run: one process, n-gram drafts (k = 4, lookup 2-4), two chat prompts
added before the first step: one that asks the model to repeat a sentence
(its drafts come from the prompt and are mostly kept) and a plain question
(few drafts), greedy. The views show both requests in the same steps, the
drafts kept and rejected, and the per-request acceptance so far. A second,
shorter run (``spec-cut``) copies a passage to its end, where the model's
EOS comes as an accepted draft with drafts after it: the step view's cut.

Beside the step views it draws, from the same spans, the verify step, p
against q at the first rejected draft's position (p computed by the model
from the recorded tokens) and ``_calc_spec_decode_metadata``'s docstring
example run through the function.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs"))

import diagrams_spec  # noqa: E402  (docs/, beside this file)
import record_assets as assets  # noqa: E402
from recording import Steps, external, step_view, steps_of  # noqa: E402

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
# The flatter q of the p-against-q figure: the target's logits at this temperature.
FLAT_TEMPERATURE = 1.5


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
    run_cut()


# A second, shorter run: a passage the model copies to its end, where the
# n-gram's drafts run past the end of the passage and the model's EOS comes
# as an accepted draft with drafts after it: the cut.
CUT_NAME = "spec-cut"
CUT_PROMPT = (
    "Repeat this passage exactly: The old lighthouse keeper climbs the stairs every"
    " evening. He lights the lamp and winds the clock."
)


def run_cut() -> None:
    from tracevllm import LLM, SamplingParams

    out = assets.fresh_run_dir(CUT_NAME)
    print(f"# {CUT_NAME}: a short copy prompt, {SPEC}", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    with LLM(
        enable_multiprocessing=False, trace_detail="request", trace_dir=out, speculative_config=SPEC
    ) as llm:
        outputs = llm.chat([[{"role": "user", "content": CUT_PROMPT}]], params, use_tqdm=False)
    print(f"  {outputs[0].request_id}: {outputs[0].outputs[0].text!r}")


def draw_cut(decode: Any) -> dict[str, Any]:
    """The step in which a stop inside an accepted run ended the request."""
    steps = steps_of(assets.load(CUT_NAME))
    cut = [i for i in sorted(steps) if any("cut" in s for s in spec_of(steps[i]).values())]
    if not cut:
        raise SystemExit(f"{CUT_NAME}: no step ended a request inside its accepted drafts")
    i = cut[0]
    spec = spec_of(steps[i])
    view = with_spec(step_view(steps[i]), spec, decode)
    assets.save_svg(f"{NAME}-step-cut.svg", render_step(view), f"step {i}")
    s = spec["0"]
    return {
        "step": i,
        "drafts": [decode([t]) for t in s["drafts"]],
        "accepted": s["accepted"],
        "kept": s["cut"]["kept"],
        "finish_reason": s["cut"]["finish_reason"],
        "stop": decode([s["drafts"][s["cut"]["kept"] - 1]]),
        "dropped": s["accepted"] + 1 - s["cut"]["kept"],
    }


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

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    views = {i: with_spec(step_view(steps[i]), specs[i], decode) for i in sorted(steps)}
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
    per_step: dict[str, Any] = {}
    for i in sorted(steps):
        s = specs[i].get("0")
        if s is None:
            continue
        drafts = " ".join(f"`{tokenizer.decode([t])}`" for t in s["drafts"])
        kept = tokenizer.decode(s["drafts"][: s["accepted"]] + [s["next"]])
        table.append(f"| {i} | {drafts} | {s['accepted']} of {len(s['drafts'])} | `{kept}` |")
        rows.append(s)
        per_step[str(i)] = {
            "accepted": s["accepted"],
            "drafts": len(s["drafts"]),
            "emitted": s["accepted"] + 1,
            "next": tokenizer.decode([s["next"]]),
            "kind": "bonus" if s["bonus"] else "recovered",
        }
    assets.write_text(f"{NAME}-drafts.md", "\n".join(table) + "\n")

    # One step with drafts, three levels deep (nothing left out): the
    # proposer and the rejection sampler in their places.
    step_span = steps[rejected]["EngineCore.step"]
    shown, level = [step_span], [step_span]
    for _ in range(3):
        ids = {s.span_id for s in level}
        level = [s for s in spans if s.parent_span_id in ids]
        shown += level
    waterfall = render_waterfall(shown)
    assert not any(row.span is None for row in waterfall.rows), "a row was folded"
    assets.save_svg(f"{NAME}-waterfall.svg", waterfall, f"step {rejected}", 80)

    verify = draw_verify(steps, specs, rejected, rejected_req, decode)
    bars = draw_bars(steps, specs, rejected, rejected_req, tokenizer)
    metadata = draw_metadata()

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
        "per_step": per_step,
        "cut": draw_cut(decode),
        "verify": verify,
        "bars": bars,
        "metadata": metadata,
    }


def _shown(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def draw_verify(
    steps: Steps, specs: dict[int, dict[str, Any]], i: int, req: str, decode: Any
) -> dict[str, Any]:
    """The verify step of request ``req`` in step ``i``, from its spans: the
    flat batch's tokens, positions and logits rows, and the rejection
    sampler's verdict."""
    prep = steps[i]["ModelRunner._prepare_inputs"].attributes
    row = [external(r) for r in prep["tracevllm.req_ids"]].index(req)
    counts = prep["tracevllm.num_scheduled_tokens"]
    start, n = sum(counts[:row]), counts[row]
    ids = prep["tracevllm.input_ids"][start : start + n]
    positions = prep["tracevllm.positions"][start : start + n]
    rows = prep["tracevllm.logits_indices"]
    spec = specs[i][req]
    # Each token of the chunk has a logits row: k drafts + 1.
    assert len(rows) >= start + n and spec["drafts"] == ids[1:], (spec, ids)
    diagrams_text = diagrams_spec.verify_step(
        i,
        req,
        positions,
        [_shown(decode([t])) for t in ids],
        rows[start : start + n],
        [_shown(decode([t])) for t in spec["drafts"]],
        spec["accepted"],
        _shown(decode([spec["next"]])),
        spec["bonus"],
    )
    assets.write_text(f"{NAME}-verify.svg", diagrams_text)
    return {
        "positions": positions,
        "first": positions[0],
        "last": positions[-1],
        "rows": rows[start : start + n],
        "last_token": decode([ids[0]]),
        "next": decode([spec["next"]]),
        "rolled_back": len(spec["drafts"]) - spec["accepted"],
    }


def _context(steps: Steps, req: str, upto: int) -> list[int]:
    """Request ``req``'s tokens at positions 0 … ``upto``, from the flat
    batches of the steps that ran them (a later step's token at a position
    replaces a rejected draft's)."""
    seq: dict[int, int] = {}
    for i in sorted(steps):
        prep = steps[i]["ModelRunner._prepare_inputs"].attributes
        names = [external(r) for r in prep["tracevllm.req_ids"]]
        if req not in names:
            continue
        row = names.index(req)
        counts = prep["tracevllm.num_scheduled_tokens"]
        start = sum(counts[:row])
        for k in range(counts[row]):
            seq[prep["tracevllm.positions"][start + k]] = prep["tracevllm.input_ids"][start + k]
    assert all(p in seq for p in range(upto + 1)), "a position no step ran"
    return [seq[p] for p in range(upto + 1)]


def draw_bars(
    steps: Steps, specs: dict[int, dict[str, Any]], i: int, req: str, tokenizer: Any
) -> dict[str, Any]:
    """p against q at the position where request ``req``'s first draft was
    rejected in step ``i``: p the model's distribution there (temperature 1,
    computed from the recorded tokens), q the n-gram's (one-hot on its
    draft), and, for the general case, a flatter q: the same logits at
    temperature FLAT_TEMPERATURE, as a small draft model's tends to be."""
    import torch
    from transformers import AutoModelForCausalLM

    from tracevllm.model_executor.model_loader import resolve_model

    spec = specs[i][req]
    prep = steps[i]["ModelRunner._prepare_inputs"].attributes
    row = [external(r) for r in prep["tracevllm.req_ids"]].index(req)
    start = sum(prep["tracevllm.num_scheduled_tokens"][:row])
    first = prep["tracevllm.positions"][start]
    # The logits at position first + accepted verify the first rejected draft.
    at = first + spec["accepted"]
    context = _context(steps, req, at)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1]  # [vocab_size]
    p = torch.softmax(logits, -1)
    # The recorded step is greedy: its recovered token is p's argmax.
    assert int(p.argmax()) == spec["next"], (int(p.argmax()), spec["next"])
    draft = spec["drafts"][spec["accepted"]]
    q_flat = torch.softmax(logits / FLAT_TEMPERATURE, -1)
    top = torch.topk(p, 6).indices.tolist()
    tokens = top + ([draft] if draft not in top else [])
    labels = [_shown(tokenizer.decode([t]))[:8] for t in tokens]
    p_row = [float(p[t]) for t in tokens]
    q_ngram = [1.0 if t == draft else 0.0 for t in tokens]
    q_row = [float(q_flat[t]) for t in tokens]
    draft_label = labels[tokens.index(draft)]
    assets.write_text(
        f"{NAME}-p-q.svg",
        diagrams_spec.accept_reject_bars(
            [
                (
                    f"step {i}, position {at}: the n-gram's draft {draft_label}, q one-hot on it",
                    labels,
                    p_row,
                    q_ngram,
                    draft_label,
                ),
                (
                    "the same position, q a flatter guess (the same logits at temperature "
                    f"{FLAT_TEMPERATURE})",
                    labels,
                    p_row,
                    q_row,
                    draft_label,
                ),
            ]
        ),
    )
    return {
        "position": at,
        "draft": tokenizer.decode([draft]),
        "p_draft": round(float(p[draft]), 3),
        "p_next": round(float(p[spec["next"]]), 3),
        "accept_ngram": round(float(p[draft]), 3),
        "flat_temperature": FLAT_TEMPERATURE,
        "accept_flat": round(float(torch.minimum(p, q_flat).sum()), 2),
    }


def draw_metadata() -> dict[str, Any]:
    """The example of ModelRunner._calc_spec_decode_metadata's docstring, run:
    three requests scheduled [4, 100, 3] tokens with [3, 0, 2] drafts."""
    from types import SimpleNamespace

    import numpy as np

    from tracevllm.worker.model_runner import ModelRunner

    scheduled, drafts = [4, 100, 3], [3, 0, 2]
    req_ids = ["a", "b", "c"]
    # Only what the function reads of the runner and the scheduler output.
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=req_ids), arange_np=np.arange(1024), device="cpu"
    )
    runner._get_cumsum_and_arange = lambda n: ModelRunner._get_cumsum_and_arange(runner, n)
    so = SimpleNamespace(
        scheduled_spec_decode_tokens={r: list(range(n)) for r, n in zip(req_ids, drafts) if n}
    )
    md = ModelRunner._calc_spec_decode_metadata(runner, so, np.cumsum(scheduled))  # type: ignore[arg-type]
    out = {
        "num_scheduled": scheduled,
        "num_drafts": drafts,
        "logits_indices": md.logits_indices.tolist(),
        "target_logits_indices": md.target_logits_indices.tolist(),
        "bonus_logits_indices": md.bonus_logits_indices.tolist(),
    }
    assets.write_text(f"{NAME}-metadata.svg", diagrams_spec.spec_metadata(**out))
    return out


def main() -> None:
    assets.rerecord_alone(__doc__, NAME, run, draw)


if __name__ == "__main__":
    main()
