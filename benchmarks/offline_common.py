"""What the offline benchmark scripts share, on either side of a comparison.

Standard library only: it is imported by the scripts that run with tracevllm's
Python (bench_throughput.py, bench_spec.py) and by those that run with the
real vLLM CPU build's (vllm_offline.py, vllm_spec_offline.py, started by
``run_in_vllm_venv``), and never by tracevllm itself. Both ``LLM`` classes
take the same ``generate(prompts, params, use_tqdm=False)`` call and the
same ``{"prompt_token_ids": [...]}`` prompts, so one timing loop serves both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def run_in_vllm_venv(venv: str, script: str, job: Any) -> Any:
    """Run ``benchmarks/<script> JOB.json OUT.json`` with the venv's Python
    (the real vLLM CPU build, fp32-sized KV cache of 2 GiB); return OUT."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
        python = os.path.join(os.path.abspath(venv), "bin", "python")  # it runs in tmp
        subprocess.run(
            [python, os.path.join(HERE, script), job_path, out_path], check=True, env=env, cwd=tmp
        )
        with open(out_path) as f:
            return json.load(f)


def job_main(run: Callable[[dict[str, Any]], Any]) -> None:
    """The vLLM side's ``__main__``: ``run`` the job in argv[1], write argv[2]."""
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = run(job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


def greedy_requests(
    sampling_params_cls: Any, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool
) -> tuple[list[dict[str, list[int]]], list[Any]]:
    """Token-id prompts and greedy params, with either engine's ``SamplingParams``."""
    params = [
        sampling_params_cls(temperature=0.0, max_tokens=m, ignore_eos=ignore_eos)
        for m in max_tokens
    ]
    return [{"prompt_token_ids": p} for p in prompts], params


def timed_generate(
    llm: Any, prompts: list[Any], params: list[Any], batch: int | None = None, num_warmups: int = 1
) -> tuple[float, list[Any]]:
    """(seconds, outputs) for every prompt, after ``num_warmups`` untimed ones:
    ``batch == 1`` one ``generate`` per request, else one over all."""
    if num_warmups:
        llm.generate(prompts[:num_warmups], params[:num_warmups], use_tqdm=False)
    start = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs
