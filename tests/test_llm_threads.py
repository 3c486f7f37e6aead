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
