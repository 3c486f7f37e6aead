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


# Segments there before this scenario began (another test's, running alongside).
_SHM_BEFORE = {n for n in os.listdir("/dev/shm") if n.startswith(SHM_NAME_PREFIX)}


def shm_segments() -> list[str]:
    """Segments made since this scenario began and still in /dev/shm."""
    now = {n for n in os.listdir("/dev/shm") if n.startswith(SHM_NAME_PREFIX)}
    return sorted(now - _SHM_BEFORE)


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


def kill_rank(model: str, tp: str, rank: str) -> None:
    """SIGKILL one worker mid-generate: EngineDeadError naming it, nothing left."""
    from tracevllm.engine.exceptions import EngineDeadError

    llm = make_llm(model, int(tp))
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
        shm=shm_segments(),
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
    say(error=error, left=wait_gone([engine_pid, *workers]), shm=shm_segments())


def ctrl_c(model: str, tp: str) -> None:
    """Print the pids, then generate until the test sends SIGINT to the group."""
    llm = make_llm(model, int(tp))
    engine_pid = llm.llm_engine.engine_core.engine_pid
    say(pids=[engine_pid, *worker_pids(engine_pid)])
    llm.generate(PROMPTS * 4, long_params(), use_tqdm=False)


def trace(model: str, tp: str, out_dir: str) -> None:
    """Generate with tracing on; the spans file is read by the test."""
    llm = make_llm(model, int(tp), trace_detail="request", trace_dir=out_dir)
    from tracevllm import SamplingParams

    outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    llm.shutdown()
    say(tokens=list(outs[0].outputs[0].token_ids))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
