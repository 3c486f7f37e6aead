"""Scenarios for tests/test_executor.py, each run in its own Python process.

``python -m tests.executor_scenarios NAME MODEL_DIR [ARGS...]`` runs one and
prints JSON lines: a crash, a hang or a killed process then fails a test
instead of pytest. The engines use the ``mp`` executor with real worker
processes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from tracevllm.distributed.device_communicators.shm_broadcast import SHM_NAME_PREFIX

PROMPTS = ["Hello there, how", "The capital of France", "1 2 3 4 5 6 7 8 9 10 11 12 13 14"]


def say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def children(pid: int) -> list[int]:
    """The child processes of ``pid``, oldest first (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry))
    return sorted(found)


def worker_pids(engine_pid: int) -> list[int]:
    """The worker processes, in rank order (started one after another)."""
    pids = []
    for pid in children(engine_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                pids.append(pid)
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def shm_now() -> set[str]:
    """tracevllm's shared-memory segments in /dev/shm now."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_NAME_PREFIX)}


# Segments there before this scenario began (another test's, running alongside).
_SHM_BEFORE = shm_now()


def shm_segments(before: set[str] | None = None) -> list[str]:
    """Segments made since ``before`` (default: since this module was
    imported) and still in /dev/shm. Another engine, starting alongside,
    may have made some: see ``lasting_shm_segments``."""
    return sorted(shm_now() - (_SHM_BEFORE if before is None else before))


def lasting_shm_segments(timeout: float = 60.0, before: set[str] | None = None) -> list[str]:
    """Segments made since ``before``, there now and still there after
    ``timeout``. An engine's segment lives from its executor's start until
    every worker has loaded the model and attached: another test's engine,
    starting alongside, holds one that long (a minute, if it compiles), then
    it goes by itself; a leaked one stays."""
    deadline = time.monotonic() + timeout
    left = shm_segments(before)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = sorted(set(left) & shm_now())
    return left


# Set in a scenario's environment by the test that starts it: every process
# the scenario starts (engine core, workers, resource tracker) inherits it,
# so the test finds them all, even once their parent is gone.
FAMILY_ENV = "TRACEVLLM_TEST_FAMILY"


def family(token: str) -> list[int]:
    """The live processes (not zombies) whose environment has FAMILY_ENV=token."""
    marker = f"{FAMILY_ENV}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:
                continue
            if marker in environ and alive(int(entry)):
                found.append(int(entry))
    return sorted(found)


# --- functions sent to the workers by collective_rpc (called as f(worker)) ----------


def rank_and_threads(worker: Any) -> tuple[int, int]:
    import torch

    return worker.rank, torch.get_num_threads()


def fail_on_purpose(worker: Any) -> None:
    raise ValueError(f"rank {worker.rank} says no")


def make_llm(model: str, tp: int, **kw: Any) -> Any:
    from tracevllm import LLM

    return LLM(
        model=model,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
        num_gpu_blocks_override=128,
        max_model_len=512,
        enable_multiprocessing=True,
        **kw,
    )


KILLED_AT: list[float] = []


def generate_killing(llm: Any, kill: Any) -> None:
    """Start PROMPTS generating, run one step (so the workers are mid-generation,
    however fast the machine), then ``kill()``, then step until the engine
    fails; every request must not finish first (480 tokens each)."""
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, long_params())
    engine.step()
    KILLED_AT.append(time.monotonic())
    kill()
    while engine.has_unfinished_requests():
        engine.step()
    raise AssertionError("every request finished although a process was killed")


def long_params() -> Any:
    from tracevllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)


def kill_rank(model: str, tp: str, rank: str, **engine_kwargs: Any) -> None:
    """SIGKILL one worker mid-generate: EngineDeadError naming it, nothing left."""
    from tracevllm.engine.exceptions import EngineDeadError

    llm = make_llm(model, int(tp), **engine_kwargs)
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


def kill_engine_core(model: str, tp: str) -> None:
    """SIGKILL EngineCore's process (the workers' parent) mid-generate."""
    from tracevllm.engine.exceptions import EngineDeadError

    llm = make_llm(model, int(tp))
    engine_pid = llm.llm_engine.engine_core.engine_pid
    workers = worker_pids(engine_pid)
    error = None
    try:
        generate_killing(llm, lambda: os.kill(engine_pid, signal.SIGKILL))
    except EngineDeadError as e:
        error = str(e)
    llm.shutdown()
    say(error=error, left=wait_gone([engine_pid, *workers]), shm=lasting_shm_segments())


def ctrl_c(model: str, tp: str) -> None:
    """Print the pids, start generating and, once a step has run, say so;
    then generate until the test sends SIGINT to the group."""
    llm = make_llm(model, int(tp))
    engine_pid = llm.llm_engine.engine_core.engine_pid
    say(pids=[engine_pid, *worker_pids(engine_pid)])
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS * 4):
        engine.add_request(str(i), prompt, long_params())
    engine.step()
    say(generating=True)
    while engine.has_unfinished_requests():
        engine.step()


def start_up(model: str, tp: str) -> None:
    """Start an engine; the test kills this process before it is up. Says
    ``ready`` if start-up ended first (it must not have)."""
    make_llm(model, int(tp))
    say(ready=True)
    time.sleep(600)


def trace(model: str, tp: str, out_dir: str) -> None:
    """Generate with tracing on; the spans file is read by the test."""
    llm = make_llm(model, int(tp), trace_detail="request", trace_dir=out_dir)
    from tracevllm import SamplingParams

    outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    llm.shutdown()
    say(tokens=list(outs[0].outputs[0].token_ids))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
