"""EngineCoreProc's busy loop against its real I/O threads and sockets.

The engine core runs in a child process (under a timeout), made by a script
that binds the frontend's sockets itself and drives the busy loop one step at
a time, so that a frame can be sent at a known point: in the middle of a
step's forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

# The frontend's side, by hand: a ROUTER and a PULL, as MPClient binds them.
ABORT_DURING_STEP = """\
import json, os, sys, tempfile, time
import zmq
from tracevllm.engine import EngineCoreOutputs, EngineCoreRequestType
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.engine.core import READY, EngineCoreProc
from tracevllm.engine.input_processor import InputProcessor
from tracevllm.engine.llm_engine import load_tokenizer
from tracevllm.sampling_params import SamplingParams
from tracevllm.serial_utils import MsgpackDecoder, MsgpackEncoder

config = EngineArgs(model=sys.argv[1], num_gpu_blocks_override=64).create_engine_config()
tmp = tempfile.mkdtemp()
ctx = zmq.Context()
router, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
router.bind(f"ipc://{tmp}/input")
pull.bind(f"ipc://{tmp}/output")
core = EngineCoreProc(config, f"ipc://{tmp}/input", f"ipc://{tmp}/output")
identity, status, _ = router.recv_multipart()
assert status == READY
encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)

def send(request_type, request):
    router.send_multipart((identity, request_type.value, encoder.encode(request)))

processor = InputProcessor(config, load_tokenizer(config.model_config.tokenizer))
params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
ids = []
for name in ("victim", "bystander"):
    request = processor.process_inputs(name, "Once upon a time", params)
    processor.assign_request_id(request)
    send(EngineCoreRequestType.ADD, request)
    ids.append(request.request_id)
victim, bystander = ids

# The third forward: the abort arrives while it runs (the input thread has
# queued it before the forward returns).
real_execute = core.model_executor.execute_model
forwards = 0
def execute_model(scheduler_output):
    global forwards
    forwards += 1
    output = real_execute(scheduler_output)
    if forwards == 3:
        send(EngineCoreRequestType.ABORT, [victim])
        deadline = time.monotonic() + 10
        while core.input_queue.empty():
            assert time.monotonic() < deadline, "the input thread never queued the abort"
            time.sleep(0.001)
    return output
core.model_executor.execute_model = execute_model

while len(core.input_queue.queue) < 2:  # both ADDs decoded
    time.sleep(0.01)
tokens = {victim: [], bystander: []}  # per step
for step in range(6):
    core._process_input_queue()
    core._process_engine_step()
    outputs = decoder.decode(pull.recv())
    for rid in tokens:
        tokens[rid].append(
            sum((o.new_token_ids for o in outputs.outputs if o.request_id == rid), [])
        )
print(json.dumps({"victim": tokens[victim], "bystander": tokens[bystander]}), flush=True)
os._exit(0)  # the engine's daemon I/O threads still poll their sockets
"""


def test_an_abort_during_the_forward_stops_the_requests_tokens_at_once(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """vLLM's eager abort queue: an abort that arrives while a step's forward
    runs is applied before that step's output is made, so the aborted
    request gets no token from it, or after; the others go on."""
    script = tmp_path / "abort_during_step.py"
    script.write_text(ABORT_DURING_STEP)
    result = subprocess.run(
        [sys.executable, str(script), tiny_model_dir],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tokens = json.loads(result.stdout.strip().splitlines()[-1])
    # Steps 1 and 2 (the prompt, then one decode) gave a token each.
    assert [len(t) for t in tokens["victim"][:2]] == [1, 1]
    assert tokens["victim"][2:] == [[], [], [], []], "a token after the abort"
    assert [len(t) for t in tokens["bystander"]] == [1] * 6
