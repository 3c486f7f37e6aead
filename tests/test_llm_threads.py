"""``LLM.generate`` from several threads at once: each call gets its own outputs.

vLLM's ``LLM`` is not thread-safe; tracevllm's runs concurrent calls one
after another (a lock), so that the engine's sockets are never used by two
threads at once and no call steps the engine for another's requests. Each
case runs in a child process under a timeout: before the lock, ZeroMQ
asserted and aborted the whole process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

SCRIPT = """\
import sys, threading
from tracevllm import LLM, SamplingParams

model, mp, rounds = sys.argv[1], sys.argv[2] == "mp", int(sys.argv[3])
# Two callers with different prompts and lengths: a mixed-up output shows.
jobs = {
    "a": (["The capital of France is", "Hello, world!"],
          SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)),
    "b": (["A paged KV cache", "0 1 2 3", "The scheduler decides"],
          SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)),
}
with LLM(model=model, num_gpu_blocks_override=128, enable_multiprocessing=mp) as llm:
    def run(name):
        prompts, params = jobs[name]
        return [(o.prompt, o.outputs[0].token_ids) for o in
                llm.generate(prompts, params, use_tqdm=False)]
    expected = {name: run(name) for name in jobs}
    for r in range(rounds):
        results, errors = {}, []
        barrier = threading.Barrier(len(jobs))
        def worker(name):
            barrier.wait()
            try:
                results[name] = run(name)
            except BaseException as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=worker, args=(n,)) for n in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert results == expected, (r, results, expected)
    # And the engine still serves, with nothing left behind.
    assert run("a") == expected["a"]
    assert not llm.llm_engine.has_unfinished_requests()
print("OK", flush=True)
"""


@pytest.mark.parametrize("mode", ["mp", "inproc"])
def test_generate_from_two_threads_gets_each_its_own_outputs(
    tiny_model_dir: str, tmp_path: Path, mode: str
) -> None:
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    for run in range(2):  # fresh processes: the race showed on 2 runs of 3
        result = subprocess.run(
            [sys.executable, str(script), tiny_model_dir, mode, "6"],
            capture_output=True,
            text=True,
            timeout=150,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        assert result.returncode == 0 and "OK" in result.stdout, (
            f"run {run}: exit {result.returncode}\n{result.stderr[-3000:]}"
        )


SHUTDOWN_SCRIPT = """\
import os, sys, threading, time
from tracevllm import LLM, SamplingParams

model, stuck = sys.argv[1], sys.argv[2] == "stuck"
llm = LLM(model=model, num_gpu_blocks_override=256)
params = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
ended = {}

def generate_until_it_fails():
    try:
        while True:  # wherever shutdown() lands, a generate is running or next
            llm.generate(["Hello"] * 16, params, use_tqdm=False)
    except BaseException as e:
        ended["error"], ended["at"] = f"{type(e).__name__}: {e}", time.monotonic()

thread = threading.Thread(target=generate_until_it_fails, daemon=True)
thread.start()
while not llm.llm_engine.has_unfinished_requests():
    time.sleep(0.01)
time.sleep(0.2)
if stuck:  # the engine stops answering (the lab below): the generate waits
    open(os.environ["STUCK_FILE"], "w").close()
    time.sleep(0.5)
start = time.monotonic()
llm.shutdown()
shutdown_s = time.monotonic() - start
thread.join(timeout=30)
if thread.is_alive():
    print("HANG: generate still running 30 s after shutdown()", flush=True)
    os._exit(3)
print("ENDED", shutdown_s, ended["at"] - start, ended["error"], flush=True)
try:
    llm.generate(["Hello"], params, use_tqdm=False)
except RuntimeError as e:
    print("AFTER", e, flush=True)
"""


# Plugged in as lab 01 (tracevllm/labs.py): the engine's own scheduler
# function, until the file appears; then the engine process blocks in it,
# answering nothing, until the shutdown's SIGTERM.
STUCK_LAB = """\
import os, time
from tracevllm.labs import reference

def compute_num_new_tokens(*args, **kwargs):
    if os.path.exists(os.environ["STUCK_FILE"]):
        time.sleep(3600)
    return reference("compute_num_new_tokens")(*args, **kwargs)
"""


@pytest.mark.parametrize(
    ("mode", "engine"), [("mp", "running"), ("inproc", "running"), ("mp", "stuck")]
)
def test_shutdown_from_another_thread_ends_a_running_generate(
    tiny_model_dir: str, tmp_path: Path, mode: str, engine: str
) -> None:
    """``LLM.shutdown()`` from a second thread while the first is in
    ``generate``: that generate ends within seconds with the shut-down error
    (at its next step; or, when the engine process answers nothing, when
    the client is shut down under it), the engine stops, and a later
    generate is refused. Before, the generate waited forever for outputs
    from a stopped engine (in process, it stepped a core being shut down)."""
    script = tmp_path / "shutdown.py"
    script.write_text(SHUTDOWN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("TRACEVLLM_ENABLE_MULTIPROCESSING", None)
    if mode == "inproc":
        env["TRACEVLLM_ENABLE_MULTIPROCESSING"] = "0"
    if engine == "stuck":
        lab = tmp_path / "01-stuck"
        lab.mkdir()
        (lab / "lab.py").write_text(STUCK_LAB)
        env["TRACEVLLM_LAB"], env["STUCK_FILE"] = str(lab), str(tmp_path / "stuck")
    try:
        result = subprocess.run(
            [sys.executable, str(script), tiny_model_dir, engine],
            capture_output=True, text=True, timeout=90, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child did not finish in 90 s: {str(e.stdout)[-2000:]}")
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout}{result.stderr[-3000:]}"
    )
    [ended] = [
        line.split(" ", 3) for line in result.stdout.splitlines() if line.startswith("ENDED")
    ]
    shutdown_s, ended_s, error = float(ended[1]), float(ended[2]), ended[3]
    assert "shut down" in error, error
    # Running: at its next step (milliseconds here); stuck: past the 5 s grace.
    limit = 15 if engine == "stuck" else 4
    assert ended_s < limit and shutdown_s < limit + 5, (ended_s, shutdown_s)
    assert "AFTER This engine has been shut down" in result.stdout, result.stdout
