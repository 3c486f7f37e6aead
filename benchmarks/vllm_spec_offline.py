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
from typing import Any

from offline_common import greedy_requests, job_main, timed_generate


def spec_counters(llm: Any) -> tuple[float, float]:
    """(drafts, accepted tokens) so far, from vLLM's Prometheus-style metrics."""
    values = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (
        values.get("vllm:spec_decode_num_drafts", 0.0),
        values.get("vllm:spec_decode_num_accepted_tokens", 0.0),
    )


def run(model: str, spec: dict[str, Any] | None, cells: list[dict[str, Any]]) -> list[dict]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", seed=0, max_num_seqs=16,
              speculative_config=spec, disable_log_stats=False)  # fmt: skip
    results = []
    for cell in cells:
        prompts, params = greedy_requests(
            SamplingParams, cell["prompts"], cell["max_tokens"], cell["ignore_eos"]
        )
        llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
        drafts0, accepted0 = spec_counters(llm)
        elapsed, outs = timed_generate(llm, prompts, params, cell["batch"], num_warmups=0)
        drafts1, accepted1 = spec_counters(llm)
        results.append({
            "seconds": elapsed, "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "drafts": drafts1 - drafts0, "accepted": accepted1 - accepted0,
        })  # fmt: skip
    del llm
    gc.collect()
    return results


if __name__ == "__main__":
    job_main(lambda job: [run(job["model"], spec, job["cells"]) for spec in (None, job["spec"])])
