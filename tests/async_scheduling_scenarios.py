"""Scenarios for tests/test_async_scheduling.py, each run in its own Python process.

``python -m tests.async_scheduling_scenarios NAME MODEL_DIR [ARGS...]`` runs one
and prints JSON lines (tests/executor_scenarios.py's helpers and engine, with
``async_scheduling=True``): a crash, a hang or a killed process fails a test
instead of pytest.
"""

from __future__ import annotations

import sys

from tests import executor_scenarios


def kill_rank(model: str, tp: str, rank: str) -> None:
    """SIGKILL one worker after the first async step: EngineDeadError, nothing left."""
    executor_scenarios.kill_rank(model, tp, rank, async_scheduling=True)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
