"""Nothing a user sends may hang or kill the engine, and no request sees another's tokens.

Every case runs against the real engine, in both process modes where the
case applies, each under a timeout so that a hang fails instead of blocking.
After each bad input a good request must still get the right answer, and no
KV block, process or socket file may be left behind. One engine per mode is
shared by the module (``engine`` fixture); cases that must break or restart
an engine make their own.
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from tracevllm import LLM, SamplingParams
from tracevllm.engine import EngineCoreRequest, EngineCoreRequestType
from tracevllm.engine.exceptions import EngineDeadError

pytestmark = pytest.mark.timeout(120)

GOOD_PROMPT = "The capital of France is"
GOOD = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _children() -> set[int]:
    """This process's descendants, less multiprocessing's resource tracker (one
    per interpreter, started by the first spawn and kept until it exits)."""
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(_cmdline(p))
    }


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:  # gone, or a zombie
        return []


@pytest.fixture(scope="module", params=["mp", "inproc"])
def engine(request: pytest.FixtureRequest, tiny_model_dir: str, tmp_path_factory: Any):
    """(llm, the good prompt's expected tokens), one engine per process mode."""
    llm = LLM(
        model=tiny_model_dir,
        num_gpu_blocks_override=64,
        enable_multiprocessing=request.param == "mp",
    )
    expected = llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False)[0].outputs[0].token_ids
    yield llm, expected
    llm.shutdown()


def assert_still_serving(llm: LLM, expected: list[int]) -> None:
    """The engine answers a good request correctly and holds nothing else."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    out = llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False)
    assert len(out) == 1 and out[0].outputs[0].token_ids == expected
    stats = engine.engine_core.get_kv_cache_stats()
    assert stats["used"] == 0 and stats["free"] == stats["total"], stats


# --- wrongly typed or out-of-range parameters ---------------------------------
TYPE_CASES = [
    ("max_tokens", True),
    ("max_tokens", 2.5),
    ("top_k", 2.5),
    ("seed", 1.5),
    ("seed", "abc"),
    ("min_tokens", 1.5),
    ("logprobs", 2.5),
    ("ignore_eos", 1),
    ("stop_token_ids", [1.5]),
    ("temperature", "0.5"),
    ("stop", [5]),
    ("stop", [None]),
    ("stop", 5),
    ("n", 2.0),
]
VALUE_CASES = [
    ("seed", 2**64),
    ("stop_token_ids", [2**70]),
    ("temperature", float("nan")),
    ("top_p", float("nan")),
    ("repetition_penalty", float("nan")),
    ("temperature", float("inf")),
    ("repetition_penalty", float("inf")),
    ("stop_token_ids", [-1]),
    ("logprobs", -2),
]


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [(f, v, TypeError) for f, v in TYPE_CASES] + [(f, v, ValueError) for f, v in VALUE_CASES],
)
def test_bad_parameters_are_refused_naming_the_field(
    engine: tuple[LLM, list[int]], field: str, value: Any, error: type[Exception]
) -> None:
    llm, expected = engine
    with pytest.raises(error, match=field):
        SamplingParams(**{field: value})
    # Set after construction (msgspec does not check assignments): the entry
    # checks again, so it never reaches the engine's input thread.
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(error, match=field):
        llm.generate([GOOD_PROMPT, GOOD_PROMPT], [GOOD, params], use_tqdm=False)
    assert_still_serving(llm, expected)


def test_a_tuple_of_stop_strings_is_a_list(engine: tuple[LLM, list[int]]) -> None:
    assert SamplingParams(stop=(".", "!")).stop == [".", "!"]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        # More than max_logprobs (20 by default), or the whole vocabulary.
        (SamplingParams(logprobs=100000), "logprobs.*max allowed: 20"),
        (SamplingParams(logprobs=-1), "logprobs.*max allowed: 20"),
        # Out of the vocabulary (the engine's min_tokens mask would index past it).
        (SamplingParams(stop_token_ids=[10**6], min_tokens=2), "stop_token_ids"),
    ],
)
def test_values_checked_against_the_model(
    engine: tuple[LLM, list[int]], params: SamplingParams, match: str
) -> None:
    llm, expected = engine
    with pytest.raises(ValueError, match=match):
        llm.generate([GOOD_PROMPT], params, use_tqdm=False)
    assert_still_serving(llm, expected)


def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_model_dir: str) -> None:
    with LLM(model=tiny_model_dir, max_logprobs=-1, enable_multiprocessing=False) as llm:
        out = llm.generate([GOOD_PROMPT], SamplingParams(max_tokens=2, logprobs=-1), use_tqdm=False)
    vocab = llm.llm_engine.model_config.vocab_size
    assert [len(position) for position in out[0].outputs[0].logprobs] == [vocab, vocab]


# --- bad prompts and arguments at the entry -----------------------------------
ENTRY_CASES: list[tuple[str, Any, type[Exception], str]] = [
    ("generate", dict(prompts=123), TypeError, "prompts"),
    ("generate", dict(prompts=["ok", "a\ud800b"]), ValueError, "prompt.*surrogate"),
    ("generate", dict(prompts="ab", sampling_params=[GOOD, {}]), ValueError, "sampling_params"),
    ("generate", dict(prompts=["a", "b"], sampling_params=[GOOD, {}]), TypeError, "params"),
    ("generate", dict(prompts=["a", "b"], priority=[0]), ValueError, "priority"),
    # A str is a sequence: its characters must not pass for a list's items.
    (
        "generate",
        dict(prompts="a", sampling_params="notparams"),
        TypeError,
        "sampling_params must be SamplingParams or a list of them, got str",
    ),
    (
        "generate",
        dict(prompts=["a"], sampling_params={"temperature": 0}),
        TypeError,
        "sampling_params .* got dict",
    ),
    ("generate", dict(prompts=b"abc"), TypeError, "prompts .* got bytes"),
    ("generate", dict(prompts=(p for p in ["a"])), TypeError, "prompts .* got generator"),
    ("generate", dict(prompts=["a"], priority="a"), TypeError, "priority must be a list.* got str"),
    ("generate", dict(prompts=["a"], priority=5), TypeError, "priority must be a list.* got int"),
    ("generate", dict(prompts=["a"], priority=[True]), TypeError, "priority .* bool"),
    ("generate", dict(prompts=["a"], priority=[0.5]), TypeError, "priority"),
    ("generate", dict(prompts=[{"prompt_token_ids": [1, "x"]}]), TypeError, "prompt_token_ids"),
    ("chat", dict(messages=[{"content": "hi"}]), ValueError, "role"),
    ("chat", dict(messages=[{"role": "user"}]), ValueError, "content"),
    ("chat", dict(messages=[{"role": "user", "content": 5}]), TypeError, "content"),
    ("chat", dict(messages="hello"), TypeError, "messages"),
    ("chat", dict(messages=[{"role": "user", "content": [{"type": "img"}]}]), ValueError, "text"),
]


@pytest.mark.parametrize(("method", "kwargs", "error", "match"), ENTRY_CASES)
def test_bad_entry_arguments_are_refused(
    engine: tuple[LLM, list[int]],
    method: str,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    llm, expected = engine
    with pytest.raises(error, match=match):
        getattr(llm, method)(use_tqdm=False, **kwargs)
    assert_still_serving(llm, expected)


def test_chat_takes_text_parts(engine: tuple[LLM, list[int]]) -> None:
    llm, _ = engine
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    a = llm.chat([{"role": "user", "content": parts}], GOOD, use_tqdm=False)
    b = llm.chat([{"role": "user", "content": "Hello\nthere"}], GOOD, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


# --- interrupted and failed steps -----------------------------------------------
def _interrupt_after(seconds: float) -> threading.Timer:
    """Ctrl-C, as the main thread sees it, after a while. Python's own
    handler first: a shell that starts a job in the background (``&``) starts
    it with SIGINT ignored, and then Python installs none."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    return timer


def test_ctrl_c_aborts_this_calls_requests_only(
    engine: tuple[LLM, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C lands, as the main thread sees it, once two steps have come
    back: triggered by the run's progress, not a clock, so a fast machine
    cannot finish the work first."""
    llm, expected = engine
    signal.signal(signal.SIGINT, signal.default_int_handler)
    real_step = llm.llm_engine.step
    steps = iter(range(1000))

    def step_then_interrupt() -> Any:
        outputs = real_step()
        if next(steps) == 1:
            _thread.interrupt_main()  # raised at the main thread's next check
        return outputs

    monkeypatch.setattr(llm.llm_engine, "step", step_then_interrupt)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([f"story number {i}" for i in range(48)], long, use_tqdm=False)
    monkeypatch.undo()
    # The next call sees only its own output, and every block came back.
    assert_still_serving(llm, expected)


@pytest.mark.parametrize("where", ["engine_core.add_request", "llm_engine.add_request"])
def test_ctrl_c_just_after_a_send_withdraws_that_request_too(
    engine: tuple[LLM, list[int]], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The interrupt lands once the third request is sent, before the call
    that sent it returns: that request too is aborted in the core, not left
    to run on (and, in-process, to sit in the scheduler) unseen."""
    llm, expected = engine
    owner = llm.llm_engine if where == "llm_engine.add_request" else llm.llm_engine.engine_core
    real = owner.add_request
    calls = iter(range(100))

    def add_then_interrupt(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if next(calls) == 2:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(owner, "add_request", add_then_interrupt)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([f"story number {i}" for i in range(6)], long, use_tqdm=False)
    monkeypatch.setattr(owner, "add_request", real)
    # A leaked request would still hold KV blocks after the good one's 6 steps.
    assert_still_serving(llm, expected)
    if not llm.llm_engine.multiprocess_mode:
        assert not llm.llm_engine.engine_core.engine_core.scheduler.has_unfinished_requests()


def test_a_failing_step_aborts_cleanly_in_process(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception (or Ctrl-C) inside EngineCore.step, in the caller's process:
    the step's requests are aborted and freed, the next call starts clean."""
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as llm:
        expected = llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False)[0].outputs[0].token_ids
        runner = llm.llm_engine.engine_core.engine_core.model_executor.model_runner
        real = runner.sample_tokens
        for error in (RuntimeError("boom in the sampler"), KeyboardInterrupt()):
            calls = iter(range(100))

            def failing(*args: Any, _error: Any = error, _calls: Any = calls, **kw: Any) -> Any:
                if next(_calls) == 2:  # the third step fails
                    raise _error
                return real(*args, **kw)

            monkeypatch.setattr(runner, "sample_tokens", failing)
            with pytest.raises(type(error)):
                llm.generate(["one", "two", "three"], GOOD, use_tqdm=False)
            monkeypatch.setattr(runner, "sample_tokens", real)
            assert_still_serving(llm, expected)


def test_request_that_fails_on_the_engine_side_gets_an_error(engine: tuple[LLM, list[int]]) -> None:
    """Bypass every frontend check and send a request whose params do not decode:
    the engine's input thread answers it with an error instead of dying."""
    llm, expected = engine
    if not llm.llm_engine.multiprocess_mode:
        pytest.skip("the input thread exists only in the engine process")
    engine_ = llm.llm_engine
    params = SamplingParams(max_tokens=3)
    params.update_from_generation_config({}, 2)
    request = EngineCoreRequest("raw", [1, 2, 3], params, time.time(), external_req_id="raw")
    params.max_tokens = True  # type: ignore[assignment]  # decodes to a bool: invalid
    engine_.output_processor.add_request(request, None)
    engine_.engine_core.add_request(request)
    outputs = []
    while engine_.has_unfinished_requests():
        outputs += engine_.step()
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"]
    assert_still_serving(llm, expected)


def test_an_unreadable_frame_reports_the_engine_dead(tiny_model_dir: str) -> None:
    """A frame with no readable request id cannot be answered: the engine must
    say it is dead rather than leave anyone waiting."""
    before = _children()
    llm = LLM(
        model=tiny_model_dir,
        num_gpu_blocks_override=16,
        max_model_len=16 * 16,
        enable_multiprocessing=True,
    )
    client = llm.llm_engine.engine_core
    socket_dir = client.resources.socket_dir
    client.input_socket.send_multipart(
        (client.core_engine, EngineCoreRequestType.ADD.value, msgspec.msgpack.encode([7]))
    )
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False)
    assert time.monotonic() - t0 < 15
    llm.shutdown()
    assert not os.path.exists(socket_dir) and _children() - before == set()


def test_reused_request_id_gets_only_its_own_tokens(engine: tuple[LLM, list[int]]) -> None:
    """A request stopped by a stop string in the frontend: the core may already
    have sampled its next token. A new request under the same id must not get it."""
    llm, _ = engine
    engine_ = llm.llm_engine
    tok = llm.get_tokenizer()
    plain = llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False)[0].outputs[0]
    stop = tok.decode(plain.token_ids[1:2])
    for _ in range(5):  # the race shows on most tries; any one must be clean
        engine_.add_request("same", GOOD_PROMPT, SamplingParams(temperature=0.0, stop=[stop]))
        while engine_.has_unfinished_requests():
            engine_.step()
        engine_.add_request("same", GOOD_PROMPT, GOOD)
        outputs = []
        while engine_.has_unfinished_requests():
            outputs += engine_.step()
        (out,) = [o for o in outputs if o.finished]
        assert out.request_id == "same"
        assert out.outputs[0].token_ids == plain.token_ids, "credited with the old request's token"


def test_abort_by_the_users_id(engine: tuple[LLM, list[int]]) -> None:
    llm, expected = engine
    engine_ = llm.llm_engine
    internal = engine_.add_request("mine", GOOD_PROMPT, SamplingParams(max_tokens=50, n=2))
    assert internal.startswith("mine-") and internal != "mine"
    engine_.step()
    engine_.abort_request(["mine"])
    assert not engine_.has_unfinished_requests()
    if not engine_.multiprocess_mode:
        engine_.step()  # the core drops the aborted children
    assert_still_serving(llm, expected)


def test_hung_engine_is_reported_and_ctrl_c_returns(
    engine: tuple[LLM, list[int]], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    llm, expected = engine
    if not llm.llm_engine.multiprocess_mode:
        pytest.skip("a separate engine process to stop")
    monkeypatch.setenv("TRACEVLLM_ENGINE_ITERATION_TIMEOUT_S", "0.5")
    pid = llm.llm_engine.engine_core.engine_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        timer = _interrupt_after(2.0)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING), pytest.raises(KeyboardInterrupt):
            llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False)
        assert time.monotonic() - t0 < 5
        timer.join()
        assert "No output from EngineCore" in caplog.text
    finally:
        os.kill(pid, signal.SIGCONT)
    assert_still_serving(llm, expected)


# --- dead engines, shut-down engines, start-up failures --------------------------
def test_dead_engine_says_what_happened(tiny_model_dir: str) -> None:
    llm = LLM(
        model=tiny_model_dir,
        num_gpu_blocks_override=16,
        max_model_len=16 * 16,
        enable_multiprocessing=True,
    )
    os.kill(llm.llm_engine.engine_core.engine_pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=r"signal 9 \(SIGKILL\)"):
        llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False)
    llm.shutdown()


def test_dead_engine_ends_the_request_spans_with_error(tiny_model_dir: str) -> None:
    """SIGKILL under a running generate: each request's llm_request span ends
    with status ERROR and the error on it (it was left open)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    with LLM(model=tiny_model_dir, num_gpu_blocks_override=64, trace_detail="request",
             enable_multiprocessing=True) as llm:  # fmt: skip
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        pid = llm.llm_engine.engine_core.engine_pid
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        engine = llm.llm_engine
        for i, prompt in enumerate(["one", "two"]):
            engine.add_request(str(i), prompt, long)
        engine.step()  # both running, however fast the machine: then the kill
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            while engine.has_unfinished_requests():
                engine.step()
        spans = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
    assert len(spans) == 2
    for span in spans:
        assert span.status.status_code == StatusCode.ERROR
        assert [ev.name for ev in span.events] == ["exception"]


@pytest.mark.parametrize("mp", [True, False])
def test_generate_after_shutdown_says_so(tiny_model_dir: str, mp: bool) -> None:
    llm = LLM(
        model=tiny_model_dir,
        num_gpu_blocks_override=16,
        max_model_len=16 * 16,
        enable_multiprocessing=mp,
    )
    llm.shutdown()
    llm.shutdown()  # twice is fine
    for call in (
        lambda: llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False),
        lambda: llm.chat([{"role": "user", "content": "hi"}], GOOD, use_tqdm=False),
    ):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


def _copy_model(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_start_up_failure_names_the_cause_at_once(tiny_model_dir: str, tmp_path: Path) -> None:
    model = _copy_model(tiny_model_dir, tmp_path / "truncated")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed to start \(it exited with exit code 1\): \w+"):
        LLM(model=str(model), enable_multiprocessing=True)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: (d / "config.json").write_text("{not json"), r"config\.json is not valid JSON"),
        (
            lambda d: (d / "config.json").write_text(
                json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})
            ),
            r"config\.json has no 'vocab_size'",
        ),
        (
            lambda d: [p.unlink() for p in d.glob("tokenizer*")],
            "has no tokenizer",
        ),
    ],
)
def test_bad_model_directories_fail_before_any_weight_loads(
    tiny_model_dir: str, tmp_path: Path, edit: Any, match: str
) -> None:
    model = _copy_model(tiny_model_dir, tmp_path / "model")
    edit(model)
    before = _children()
    with pytest.raises(ValueError, match=match):
        LLM(model=str(model), enable_multiprocessing=True)
    assert _children() - before == set()  # no engine process was started


def test_fake_gguf_leaves_no_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEVLLM_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="Could not convert"):
        LLM(model=str(fake))
    assert not (tmp_path / "cache" / "gguf").exists()


# --- the model's generation config -----------------------------------------------
def test_generation_config_stop_ids_and_defaults(tiny_model_dir: str, tmp_path: Path) -> None:
    """Extra EOS ids (Llama 3 instruct's <|eot_id|>) stop requests; sampling
    defaults become LLM.get_default_sampling_params()."""
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as llm:
        free = llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False)[0].outputs[0].token_ids
    model = _copy_model(tiny_model_dir, tmp_path / "model")
    config = json.loads((model / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], free[2]]
    config |= {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7}
    (model / "generation_config.json").write_text(json.dumps(config))
    with LLM(model=str(model), enable_multiprocessing=False) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.6, 0.9, 7)
        out = llm.generate([GOOD_PROMPT], SamplingParams(temperature=0.0, max_tokens=6))
        completion = out[0].outputs[0]
        assert completion.token_ids == free[:3] and completion.stop_reason == free[2]
        # ignore_eos: the model's EOS ids no longer stop it.
        out = llm.generate([GOOD_PROMPT], GOOD, use_tqdm=False)
        assert out[0].outputs[0].token_ids == free
    with LLM(model=str(model), generation_config="vllm", enable_multiprocessing=False) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


# --- the frontend process dies or is interrupted: nothing is left ------------------
SCRIPT = """\
import os, sys, time
from tracevllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], num_gpu_blocks_override=64)
print("ENGINE", llm.llm_engine.engine_core.engine_pid, flush=True)
params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
if sys.argv[2] == "exit":
    os._exit(0)
llm.generate(["once upon a time"] * 32, params, use_tqdm=False)
"""


@pytest.mark.parametrize("how", ["sigterm", "exit", "two-ctrl-c", "sigkill"])
def test_a_dying_frontend_leaves_no_process_or_socket(
    tiny_model_dir: str, tmp_path: Path, how: str
) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, str(script), tiny_model_dir, "exit" if how == "exit" else "run"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ENGINE"), line
    engine_pid = int(line.split()[1])
    if how != "exit":
        time.sleep(1.0)  # mid-generate
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif how == "sigkill":
            proc.kill()
        else:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (psutil.pid_exists(engine_pid) or any(tmpdir.iterdir())):
        time.sleep(0.1)
    if psutil.pid_exists(engine_pid):
        status = psutil.Process(engine_pid).status()
        assert status == psutil.STATUS_ZOMBIE, f"engine process still {status}"
    assert list(tmpdir.iterdir()) == [], "socket files left behind"


def test_cli_shuts_down_cleanly_on_sigterm(tiny_model_dir: str, tmp_path: Path) -> None:
    """`tracevllm generate` takes SIGTERM as vLLM's CLI does: an orderly exit."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    before = _children()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracevllm.entrypoints.cli", "generate", "--prompt", "Hi",
         "--model", tiny_model_dir, "--max-tokens", "400", "--raw"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    # Mid-generate: the engine process exists and has worked a while (its CPU time).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        engines = psutil.Process(proc.pid).children()
        if engines and sum(engines[0].cpu_times()[:2]) > 3.0:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmpdir.iterdir()) == [] and _children() - before == set()


def test_readme_example_runs_as_a_script_without_a_main_guard(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    script = tmp_path / "example.py"
    script.write_text(
        textwrap.dedent(
            f"""\
            from tracevllm import LLM, SamplingParams

            llm = LLM(model={tiny_model_dir!r})
            params = SamplingParams(temperature=0.0, max_tokens=5)
            for out in llm.generate(["The capital of France is"], params):
                print("DONE", len(out.outputs[0].token_ids))
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "DONE 5" in result.stdout
