"""The vLLM side of ``make bench``: run in the real vLLM CPU build's venv.

    VLLM_VENV/bin/python benchmarks/vllm_offline.py JOB.json OUT.json

JOB.json (written by bench_throughput.py): the model directory, the prompt
token ids, their max_tokens, the warm-up count and the engine configs
(bench_throughput.py sends one a process, so each runs under its own
condition: ``enforce_eager=True``, then vLLM's default ``torch.compile``
path). For each
config one vLLM ``LLM`` (fp32, greedy, ``ignore_eos``) generates every prompt
in one ``generate`` call after the same warm-up as tracevllm's, and OUT.json
gets, per config, the seconds, the tokens generated and the prompt tokens
vLLM's prefix cache supplied in the timed call (the sum of its
``RequestOutput.num_cached_tokens``; null if any output leaves it None), from
which bench_throughput.py counts that run's linear-FLOP floor. Never imported
by tracevllm.
"""

from __future__ import annotations

import gc
from typing import Any

from offline_common import greedy_requests, job_main, timed_generate


def cached_tokens(outs: list[Any]) -> int | None:
    """The prompt tokens the prefix cache supplied over ``outs`` (RequestOutputs);
    None if any of them does not say (vLLM's ``num_cached_tokens`` may be None)."""
    counts = [getattr(o, "num_cached_tokens", None) for o in outs]
    if any(c is None for c in counts):
        return None
    return sum(counts)


def run(job: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams

    prompts, params = greedy_requests(SamplingParams, job["prompts"], job["max_tokens"], True)
    results = []
    for config in job["configs"]:
        llm = LLM(model=job["model"], dtype="float32", seed=0, **config)
        seconds, outs = timed_generate(llm, prompts, params, num_warmups=job["num_warmups"])
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results.append({"config": config, "seconds": seconds, "tokens": tokens,
                        "cached_tokens": cached_tokens(outs)})  # fmt: skip
        del llm
        gc.collect()
    return results


if __name__ == "__main__":
    job_main(run)
