"""Scenarios for tests/test_async_scheduling.py, each run in its own Python process.

``python -m tests.async_scheduling_scenarios NAME MODEL_DIR [ARGS...]`` runs one
and prints JSON lines (tests/executor_scenarios.py's helpers and engine, with
``async_scheduling=True``): a crash, a hang or a killed process fails a test
instead of pytest.
"""

from __future__ import annotations

import sys

from tests import executor_scenarios
from tests.executor_scenarios import make_llm, say


def kill_rank(model: str, tp: str, rank: str) -> None:
    """SIGKILL one worker after the first async step: EngineDeadError, nothing left."""
    executor_scenarios.kill_rank(model, tp, rank, async_scheduling=True)


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
