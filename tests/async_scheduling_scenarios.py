"""Scenarios for tests/test_async_scheduling.py, each run in its own Python process.

``python -m tests.async_scheduling_scenarios NAME MODEL_DIR [ARGS...]`` runs one
and prints JSON lines (tests/executor_scenarios.py's helpers and engine, with
``async_scheduling=True``): a crash, a hang or a killed process fails a test
instead of pytest.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from tests.executor_scenarios import (
    KILLED_AT,
    generate_killing,
    lasting_shm_segments,
    make_llm,
    say,
    wait_gone,
    worker_pids,
)


def kill_rank(model: str, tp: str, rank: str) -> None:
    """SIGKILL one worker after the first async step: EngineDeadError, nothing left."""
    from tracevllm.engine.exceptions import EngineDeadError

    llm = make_llm(model, int(tp), async_scheduling=True)
    client = llm.llm_engine.engine_core
    engine_pid, socket_dir = client.engine_pid, client.resources.socket_dir
    workers = worker_pids(engine_pid)
    victim = workers[int(rank)]
    error = None
    try:
        generate_killing(llm, lambda: os.kill(victim, signal.SIGKILL))
    except EngineDeadError as e:
        error = str(e)
    waited = time.monotonic() - KILLED_AT[-1]
    llm.shutdown()
    say(
        error=error,
        waited=waited,
        victim=victim,
        left=wait_gone([engine_pid, *workers]),
        shm=lasting_shm_segments(),
        socket_dir=os.path.exists(socket_dir),
    )


def trace(model: str, async_scheduling: str, out_dir: str) -> None:
    """One request, 12 greedy tokens, traced; the test reads the spans file."""
    from tracevllm import SamplingParams

    llm = make_llm(
        model,
        1,
        async_scheduling=async_scheduling == "on",
        trace_detail="request",
        trace_dir=out_dir,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(["The capital of France"], params, use_tqdm=False)
    llm.shutdown()
    say(tokens=list(outs[0].outputs[0].token_ids))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
