"""The vLLM side of ``make bench-spec``: run in the real vLLM CPU build's venv.

    VLLM_VENV/bin/python benchmarks/vllm_spec_offline.py JOB.json OUT.json

JOB.json (written by bench_spec.py): the model directory, the speculative
config and the cells (prompt token ids, max_tokens, batch). For each of "no
drafts" and "n-gram drafts" one vLLM ``LLM`` (fp32) runs every cell as
bench_spec.py runs tracevllm's, and OUT.json gets, per cell, the seconds,
the token ids, and the drafts and accepted tokens from vLLM's own
spec-decode counters (``LLM.get_metrics``). Never imported by tracevllm.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any


def spec_counters(llm: Any) -> tuple[float, float]:
    """(drafts, accepted tokens) so far, from vLLM's Prometheus-style metrics."""
    values = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (
        values.get("vllm:spec_decode_num_drafts", 0.0),
        values.get("vllm:spec_decode_num_accepted_tokens", 0.0),
    )


def run(model: str, spec: dict[str, Any] | None, cells: list[dict[str, Any]]) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", seed=0, max_num_seqs=16,
              speculative_config=spec, disable_log_stats=False)  # fmt: skip
    results = []
    for cell in cells:
        params = [
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=cell["ignore_eos"])
            for m in cell["max_tokens"]
        ]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cell["prompts"]]
        llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
        drafts0, accepted0 = spec_counters(llm)
        t0 = time.perf_counter()
        if cell["batch"] == 1:
            outs = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        drafts1, accepted1 = spec_counters(llm)
        results.append({
            "seconds": elapsed, "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "drafts": drafts1 - drafts0, "accepted": accepted1 - accepted0,
        })  # fmt: skip
    del llm
    gc.collect()
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    out = [run(job["model"], None, job["cells"]), run(job["model"], job["spec"], job["cells"])]
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
