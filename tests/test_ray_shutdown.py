"""``tracevllm serve --distributed-executor-backend ray``, stopped the three
ways a server is stopped: a terminal's Ctrl-C (SIGINT to its whole process
group), SIGTERM to the server alone, SIGKILL to the server alone.

With no cluster to join, the engine core starts Ray on this machine: the GCS
server, the raylet, the raylet's dashboard and runtime-env agents, and one
actor per rank. None of them may outlive the run. Each server runs in its own
session (``setsid``); every process it starts stays in that session (Ray
moves its actors to process groups of their own, not to other sessions), so
whatever is left in the session once the server is gone is a leak, even a
process that was re-parented to init. Skipped without Ray (``make
setup-ray``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import time
from typing import Any

import psutil
import pytest

requires_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed (make setup-ray)"
)


def session_processes(sid: int) -> dict[int, str]:
    """Every live process of session ``sid``: pid -> its name (Ray's
    processes name themselves ``ray::...``)."""
    found = {}
    for pid in psutil.pids():
        try:
            if os.getsid(pid) != sid:
                continue
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                found[pid] = p.name()
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def wait_session_empty(sid: int, timeout: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.3)
    return left


@requires_ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["ctrl_c", "sigterm", "sigkill"])
def test_stopped_ray_server_leaves_no_process(tiny_model_dir: str, tmp_path: Any, how: str) -> None:
    from tests.test_serving import MODEL, Server

    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        try:
            server = Server(
                tiny_model_dir,
                *("-tp", "2", "--distributed-executor-backend", "ray"),
                start_new_session=True,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        except RuntimeError as e:
            raise RuntimeError(f"{e}; its log:\n{log_path.read_text()[-3000:]}") from e
    sid = server.proc.pid
    try:
        # One completion: the actors are up and have run steps.
        completion = server.client().completions.create(
            model=MODEL, prompt="Hello", max_tokens=4, temperature=0.0
        )
        assert completion.choices[0].text is not None
        # Ray names an actor's process once it runs: wait for both names.
        deadline = time.monotonic() + 30
        while True:
            names = list(session_processes(sid).values())
            if names.count("ray::RayWorkerWrapper") >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        # The Ray instance this run started, and its two actors.
        assert {"raylet", "gcs_server"} <= set(names), names
        assert names.count("ray::RayWorkerWrapper") == 2, names
        if how == "ctrl_c":
            os.killpg(sid, signal.SIGINT)
        elif how == "sigterm":
            server.proc.send_signal(signal.SIGTERM)
        else:
            server.proc.kill()
        server.proc.wait(60)
        # Ray's agents give up on a dead GCS only after a minute: a leak
        # outlasts this wait.
        left = wait_session_empty(sid, timeout=30)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(30)
        for pid in session_processes(sid):  # only this run's: its own session
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    log_text = log_path.read_text()
    assert left == {}, f"{left} left after {how}; server log:\n{log_text[-3000:]}"
