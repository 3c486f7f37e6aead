"""A pipeline stage before the last one fails inside ``execute_model``.

Only the output rank (TP rank 0 of the last stage) answers a step, and the
last stage waits for the first one's tensors in ``recv_tensor_dict``: without
word from the failed stage it would wait for gloo's timeout (300 s) before
anyone heard of the error. The scenario runs in a child process (``python -m
tests.test_pp_stage_failure NAME MODEL``) under a timeout, and prints one
JSON line: P = 2 on the tiny Llama with the ``mp`` executor's real worker
processes, EngineCore in the caller's process so that the executor is at
hand; after one step (an observed event, not a timer) rank 0's model runner
is made to raise on its next forward. The step must fail within seconds,
naming rank 0 and its error; the step's requests are finished with an
error, the engine takes the next request, and shutdown leaves no worker
process or shared-memory segment behind.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pytest

from tests.executor_scenarios import lasting_shm_segments, wait_gone, worker_pids
from tests.utils import run_json_lines

PROMPTS = ["Hello there, how", "The capital of France", "1 2 3 4 5 6 7 8 9"]


# --- run on every rank through collective_rpc (called as f(worker)) ----------------
def fail_next_forward(worker: Any, rank: int) -> None:
    """On global rank ``rank``: the model runner's next forward raises (a
    step with tokens; with the batch queue a step may schedule none)."""
    if worker.rank != rank:
        return
    runner = worker.worker.model_runner
    execute_model_of_class = runner.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if not scheduler_output.total_num_scheduled_tokens:
            return execute_model_of_class(scheduler_output, *args, **kwargs)
        del runner.execute_model  # once: the class's method again
        raise ValueError(f"stage of rank {worker.rank} says no")

    runner.execute_model = execute_model


def _say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def _failing_stage(model: str, rank: str) -> None:
    from tracevllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        num_gpu_blocks_override=64,
        max_model_len=256,
        enable_multiprocessing=False,
    )
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    workers = worker_pids(os.getpid())
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    engine.step()  # the workers are mid-generation
    core.model_executor.collective_rpc(fail_next_forward, args=(int(rank),))
    start = time.monotonic()
    error = None
    try:
        while engine.has_unfinished_requests():
            engine.step()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    waited = time.monotonic() - start
    stats = core.get_kv_cache_stats()
    # The engine goes on: the next request runs on both stages.
    outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    llm.shutdown()
    _say(
        error=error,
        waited=waited,
        blocks_back=stats["used"] == 0,
        after=len(outs[0].outputs[0].token_ids),
        workers=len(workers),
        left=wait_gone(workers),
        shm=lasting_shm_segments(),
    )


@pytest.mark.timeout(300)
def test_failing_first_stage_is_reported_in_seconds(tiny_model_dir: str) -> None:
    (out,) = run_json_lines(
        "tests.test_pp_stage_failure", "_failing_stage", tiny_model_dir, "0", timeout=240
    )
    assert out["error"] is not None, out
    assert "rank 0" in out["error"] and "stage of rank 0 says no" in out["error"], out
    assert out["waited"] < 10, out
    assert out["blocks_back"], out
    assert out["after"] == 4, out
    assert out["workers"] == 2 and out["left"] == [] and out["shm"] == [], out


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
