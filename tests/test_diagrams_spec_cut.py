"""The spec view records a stop inside an accepted run of drafts as the cut it
is: the scheduler keeps the tokens up to the stop and drops the rest, and
``tracevllm.view.spec`` says how many it kept and why the request finished."""

from __future__ import annotations

import json
import os
from typing import Any

from tracevllm.tracing.exporters import read_spans_jsonl

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
PROMPT = (
    "Repeat this passage exactly: The old lighthouse keeper climbs the stairs every"
    " evening. He lights the lamp and winds the clock."
)


def _spec_steps(trace_dir: str, max_tokens: int, model: str) -> list[dict[str, Any]]:
    """Each step's spec view for one greedy copy request, in step order."""
    from tracevllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    with LLM(
        model=model,
        enable_multiprocessing=False,
        trace_detail="request",
        trace_dir=trace_dir,
        speculative_config=NGRAM,
    ) as llm:
        llm.chat([[{"role": "user", "content": PROMPT}]], params, use_tqdm=False)
    spans = read_spans_jsonl(os.path.join(trace_dir, "spans.jsonl"))
    views = [
        s
        for s in sorted(spans, key=lambda s: s.start_ns)
        if s.name == "Scheduler.update_from_output" and "tracevllm.view.spec" in s.attributes
    ]
    return [next(iter(json.loads(s.attributes["tracevllm.view.spec"]).values())) for s in views]


def test_an_eos_accepted_inside_a_run_of_drafts_is_recorded_as_a_cut(
    tmp_path: Any, default_model_dir: str, tokenizer: Any
) -> None:
    """The passage ends, and the n-gram's drafts run past its end: the
    model's EOS comes as an accepted draft with drafts after it."""
    steps = _spec_steps(str(tmp_path), 48, default_model_dir)
    eos = tokenizer.eos_token_id
    last = steps[-1]
    emitted = [*last["drafts"][: last["accepted"]], last["next"]]
    assert eos in emitted[:-1], f"no EOS inside the accepted run: {steps}"
    assert last["cut"] == {"kept": emitted.index(eos) + 1, "finish_reason": "stop"}
    assert not any("cut" in s for s in steps[:-1])
