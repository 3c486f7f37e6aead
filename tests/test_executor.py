"""ParallelConfig, the parallel flags, Executor.get_class and the executors.

The multiprocess executor's tests run real worker processes (one per rank)
on the tiny model; the engines are shared across tests (module fixtures).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracevllm.config import ParallelConfig, available_cpu_count
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.executor import Executor
from tracevllm.executor.multiproc_executor import MultiprocExecutor
from tracevllm.executor.uniproc_executor import UniProcExecutor

# --- ParallelConfig: vLLM's defaults and errors ----------------------------------


def test_parallel_config_defaults_are_vllms() -> None:
    config = ParallelConfig()
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (1, 1)
    assert config.data_parallel_size == 1
    assert config.world_size == 1
    assert config.distributed_executor_backend == "uni"


@pytest.mark.parametrize(
    ("kwargs", "world_size", "backend"),
    [
        (dict(tensor_parallel_size=2), 2, "mp"),
        (dict(pipeline_parallel_size=2), 2, "mp"),
        (dict(tensor_parallel_size=2, pipeline_parallel_size=2), 4, "mp"),
        (dict(data_parallel_size=2), 1, "mp"),  # D engines of one worker
        (dict(tensor_parallel_size=1, distributed_executor_backend="mp"), 1, "mp"),
    ],
)
def test_world_size_and_default_backend(kwargs: dict, world_size: int, backend: str) -> None:
    config = ParallelConfig(**kwargs)
    assert config.world_size == world_size
    assert config.distributed_executor_backend == backend


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(tensor_parallel_size=True), TypeError, "tensor_parallel_size must be an int"),
        (dict(pipeline_parallel_size=2.0), TypeError, "pipeline_parallel_size must be an int"),
        (dict(data_parallel_size=0), ValueError, "data_parallel_size must be at least 1, got 0"),
        (dict(tensor_parallel_size=-1), ValueError, "tensor_parallel_size must be at least 1"),
        (
            dict(distributed_executor_backend="threads"),
            ValueError,
            "Unrecognized distributed executor backend 'threads'",
        ),
        (dict(distributed_executor_backend=int), ValueError, "Unrecognized distributed executor"),
        (
            dict(tensor_parallel_size=2, distributed_executor_backend="uni"),
            ValueError,
            "'uni' runs one worker, but world size",
        ),
        (dict(data_parallel_rank=2, data_parallel_size=2), ValueError, "must be in the range"),
    ],
)
def test_parallel_config_errors(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        ParallelConfig(**kwargs)


def test_ray_backend_without_ray_is_vllms_error() -> None:
    import importlib.util

    if importlib.util.find_spec("ray") is not None:
        pytest.skip("Ray is installed")
    with pytest.raises(ValueError, match="Failed to import Ray.*pip install ray"):
        ParallelConfig(distributed_executor_backend="ray")


def test_more_ranks_than_cpus_is_a_warning_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    cpus = available_cpu_count()
    with caplog.at_level(logging.WARNING, logger="tracevllm.config"):
        config = ParallelConfig(tensor_parallel_size=cpus + 1)
    assert config.world_size == cpus + 1
    assert f"World size ({cpus + 1}) is larger than the number of available CPUs" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tracevllm.config"):
        ParallelConfig(tensor_parallel_size=cpus)
    assert "World size" not in caplog.text


def test_heads_must_divide_by_tensor_parallel_size(default_model_dir: str) -> None:
    """vLLM's message, on the default model (9 query heads)."""
    args = EngineArgs(model=default_model_dir, tensor_parallel_size=2)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Total number of attention heads (9) must be divisible by tensor parallel size (2)."
        ),
    ):
        args.create_engine_config()
    config = EngineArgs(model=default_model_dir, tensor_parallel_size=3).create_engine_config()
    assert config.parallel_config.world_size == 3


@pytest.mark.parametrize(
    ("pp", "partition", "message"),
    [
        (
            3,
            None,
            "pipeline_parallel_size (3) must not be larger than the model's number of "
            "hidden layers (2): each pipeline stage needs at least one layer, so "
            "pipeline_parallel_size may be 1 to 2.",
        ),
        (2, "2,0", "TRACEVLLM_PP_LAYER_PARTITION='2,0' gives pipeline stages [2, 0] layers"),
        (2, "3,-1", "TRACEVLLM_PP_LAYER_PARTITION='3,-1' gives pipeline stages [3, -1]"),
        # vLLM's get_pp_indices errors, now before any worker starts.
        (2, "1,1,0", "len(partitions)=3 does not match pp_size=2."),
        (2, "1,2", "sum(partitions)=3 does not match num_hidden_layers=2."),
    ],
)
def test_every_pipeline_stage_needs_a_layer(
    tiny_model_dir: str,
    monkeypatch: pytest.MonkeyPatch,
    pp: int,
    partition: str | None,
    message: str,
) -> None:
    """Refused in the config (the tiny model has 2 layers), not later in a
    worker with a stage of no layers ('load_model() first')."""
    if partition is None:
        monkeypatch.delenv("TRACEVLLM_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("TRACEVLLM_PP_LAYER_PARTITION", partition)
    args = EngineArgs(
        model=tiny_model_dir, pipeline_parallel_size=pp, distributed_executor_backend="mp"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        args.create_engine_config()


@pytest.mark.timeout(120)
def test_llm_refuses_more_stages_than_layers_before_starting_a_process(
    tiny_model_dir: str,
) -> None:
    import os

    before = scenarios.children(os.getpid())
    with pytest.raises(ValueError, match=re.escape("pipeline_parallel_size (3)")):
        LLM(model=tiny_model_dir, pipeline_parallel_size=3, distributed_executor_backend="mp")
    assert scenarios.children(os.getpid()) == before
    config = EngineArgs(model=tiny_model_dir, pipeline_parallel_size=2).create_engine_config()
    assert config.parallel_config.world_size == 2  # as many stages as layers is fine


# --- the flags --------------------------------------------------------------------


def test_cli_flags_and_their_short_forms() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args([]))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (1, 1)
    assert (args.data_parallel_size, args.distributed_executor_backend) == (1, None)
    short = parser.parse_args(
        ["-tp", "3", "-pp", "2", "-dp", "2", "--distributed-executor-backend", "mp"]
    )
    long = parser.parse_args(
        [
            "--tensor-parallel-size",
            "3",
            "--pipeline-parallel-size",
            "2",
            "--data-parallel-size",
            "2",
            "--distributed-executor-backend",
            "mp",
        ]
    )
    assert vars(short) == vars(long)
    args = EngineArgs.from_cli_args(short)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (3, 2)
    assert (args.data_parallel_size, args.distributed_executor_backend) == (2, "mp")
    with pytest.raises(SystemExit):
        parser.parse_args(["--distributed-executor-backend", "threads"])


def test_serve_takes_the_parallel_flags() -> None:
    from tracevllm.entrypoints.cli import make_parser

    args = make_parser().parse_args(["serve", "-tp", "2", "--distributed-executor-backend", "uni"])
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "uni")


# --- Executor.get_class --------------------------------------------------------------


class _MyExecutor(UniProcExecutor):
    pass


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("uni", UniProcExecutor),
        ("mp", MultiprocExecutor),
        (_MyExecutor, _MyExecutor),
        (f"{__name__}._MyExecutor", _MyExecutor),
    ],
)
def test_get_class_picks_the_executor(backend: object, expected: type) -> None:
    config = argparse.Namespace(
        parallel_config=ParallelConfig(distributed_executor_backend=backend)  # type: ignore[arg-type]
    )
    assert Executor.get_class(config) is expected  # type: ignore[arg-type]


def test_get_class_refuses_an_import_path_that_is_no_executor() -> None:
    config = argparse.Namespace(
        parallel_config=ParallelConfig(distributed_executor_backend="argparse.Namespace")
    )
    with pytest.raises(TypeError, match="must be a subclass of Executor"):
        Executor.get_class(config)  # type: ignore[arg-type]


# --- the executors on real workers ---------------------------------------------------

from tests import executor_scenarios as scenarios  # noqa: E402
from tracevllm import LLM, SamplingParams  # noqa: E402


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _inproc_llm(model: str, **kw: object) -> LLM:
    # In this process, so the test reaches the executor; its workers are processes.
    return LLM(model=model, num_gpu_blocks_override=64, enable_multiprocessing=False, **kw)


@pytest.fixture(scope="module")
def uni_tokens(tiny_model_dir: str) -> list[list[int]]:
    llm = _inproc_llm(tiny_model_dir)
    assert isinstance(llm.llm_engine.engine_core.engine_core.model_executor, UniProcExecutor)
    outs = llm.generate(scenarios.PROMPTS, _greedy(), use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def mp1_llm(tiny_model_dir: str):
    llm = _inproc_llm(tiny_model_dir, distributed_executor_backend="mp")
    yield llm
    llm.shutdown()


def _executor(llm: LLM) -> Executor:
    return llm.llm_engine.engine_core.engine_core.model_executor


def test_one_worker_process_gives_the_uniproc_tokens(
    mp1_llm: LLM, uni_tokens: list[list[int]]
) -> None:
    executor = _executor(mp1_llm)
    assert isinstance(executor, MultiprocExecutor)
    outs = mp1_llm.generate(scenarios.PROMPTS, _greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == uni_tokens


def test_collective_rpc_answers_per_rank_or_from_one(mp1_llm: LLM) -> None:
    import os

    executor = _executor(mp1_llm)
    ((rank, threads),) = executor.collective_rpc(scenarios.rank_and_threads)
    assert rank == 0 and threads >= 1
    assert executor.collective_rpc(scenarios.rank_and_threads, unique_reply_rank=0)[0] == 0
    assert executor.collective_rpc("check_health") == [None]
    assert executor.workers[0].proc.pid != os.getpid()


def test_a_worker_error_is_reported_and_the_executor_goes_on(mp1_llm: LLM) -> None:
    executor = _executor(mp1_llm)
    with pytest.raises(RuntimeError, match="Worker failed with error 'rank 0 says no'"):
        executor.collective_rpc(scenarios.fail_on_purpose)
    assert executor.collective_rpc(scenarios.rank_and_threads)[0][0] == 0


def test_a_function_a_worker_cannot_load_is_an_error_not_a_dead_worker(
    mp1_llm: LLM, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A function from a module only this process can import (as a test
    module's): the worker answers with its import error and keeps serving."""
    import importlib

    (tmp_path / "only_here_probe.py").write_text("def probe(worker):\n    return worker.rank\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = importlib.import_module("only_here_probe").probe
    executor = _executor(mp1_llm)
    with pytest.raises(RuntimeError, match="No module named 'only_here_probe'"):
        executor.collective_rpc(probe)
    assert not executor.is_failed
    assert executor.collective_rpc(scenarios.rank_and_threads)[0][0] == 0


def _run_scenario(*args: str, timeout: float = 180) -> list[dict]:
    from tests.utils import run_json_lines

    return run_json_lines("tests.executor_scenarios", *args, timeout=timeout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("tp", "rank"), [("1", 0), ("2", 1)])
def test_a_killed_rank_is_engine_dead_naming_it_and_nothing_is_left(
    tiny_model_dir: str, tp: str, rank: int
) -> None:
    (out,) = _run_scenario("kill_rank", tiny_model_dir, tp, str(rank), timeout=240)
    assert out["error"] is not None, out
    victim = f"VllmWorker-{rank} (rank {rank}, pid {out['victim']}) exited with signal 9"
    assert victim in out["error"], out
    assert out["waited"] < 10, out
    assert out["left"] == [] and out["shm"] == [] and not out["socket_dir"], out


def test_a_killed_engine_core_takes_its_workers_along(tiny_model_dir: str) -> None:
    (out,) = _run_scenario("kill_engine_core", tiny_model_dir, "1")
    assert "EngineCore process" in out["error"] and "SIGKILL" in out["error"]
    assert out["left"] == [] and out["shm"] == []


class _Scenario:
    """A scenario in its own session (a terminal's Ctrl-C reaches the whole
    group), with its own TMPDIR (so its socket and rendezvous files are seen)
    and a family token in its environment (so every process it starts is
    found, even once reparented)."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        import uuid

        from tests.utils import REPO_ROOT

        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir()
        self.token = uuid.uuid4().hex
        self.log_path = tmp_path / "stderr.log"
        self.shm_before = scenarios.shm_now()
        env = {**os.environ, "TMPDIR": str(self.tmpdir), scenarios.FAMILY_ENV: self.token}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.executor_scenarios", *args],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
                env=env,
                cwd=REPO_ROOT,
            )

    def family(self) -> list[int]:
        return scenarios.family(self.token)

    def kill_all(self) -> None:
        """Whatever of it is left, by pid (never by name)."""
        for pid in [self.proc.pid, *self.family()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def wait_family_gone(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while self.family() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.family()

    def files_left(self) -> list[str]:
        """tracevllm's temporary directories (sockets, rendezvous) still there."""
        return sorted(p.name for p in self.tmpdir.iterdir() if p.name.startswith("tracevllm"))

    def stderr(self) -> str:
        return self.log_path.read_text()


def _has_loaded_torch(pid: int) -> bool:
    """Past reading what its parent sent it, and importing the engine."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return b"libtorch" in f.read()
    except OSError:
        return False


def _engine_core_pid(frontend: int) -> int | None:
    """The frontend's child running EngineCore (the one that is no resource tracker)."""
    for pid in scenarios.children(frontend):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                return pid
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", ["engine_core_started", "workers_started"])
def test_a_frontend_killed_during_start_up_leaves_nothing(
    tiny_model_dir: str, tmp_path: Path, phase: str
) -> None:
    """SIGKILL the frontend while EngineCore is still starting (TP = 2): once
    its process is importing the engine, or once it has started its workers
    (which are loading the model). EngineCore sees its parent gone, stops starting,
    stops the workers and leaves: every process of the family gone within
    seconds, no segment, no socket or rendezvous file, and never READY."""
    run = _Scenario(tmp_path, "start_up", tiny_model_dir, "2")
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and run.proc.poll() is None:
            engine = _engine_core_pid(run.proc.pid)
            if engine is not None and (
                _has_loaded_torch(engine)
                if phase == "engine_core_started"
                else len(scenarios.worker_pids(engine)) == 2
            ):
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"no {phase} within 180 s: {run.stderr()[-3000:]}")
        assert run.family(), "the scenario's processes carry its token"
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=10)
        left = run.wait_family_gone(timeout=15)
    finally:
        run.kill_all()
    assert run.proc.stdout is not None
    assert "ready" not in run.proc.stdout.read(), "start-up ended before the kill"
    assert left == [], run.stderr()[-3000:]
    assert "frontend process is gone while EngineCore was starting" in run.stderr()
    assert run.files_left() == []  # no socket directory, no rendezvous
    assert scenarios.lasting_shm_segments(before=run.shm_before) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", ["1", "2"])
def test_ctrl_c_stops_the_frontend_engine_and_workers(
    tiny_model_dir: str, tmp_path: Path, tp: str
) -> None:
    import json

    run = _Scenario(tmp_path, "ctrl_c", tiny_model_dir, tp)
    try:
        assert run.proc.stdout is not None
        pids = json.loads(run.proc.stdout.readline())["pids"]
        assert len(pids) == 1 + int(tp)  # EngineCore and its workers
        assert json.loads(run.proc.stdout.readline()) == {"generating": True}
        os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        run.proc.wait(timeout=60)
        left = run.wait_family_gone(timeout=15)
    finally:
        run.kill_all()
    assert left == [], run.stderr()[-3000:]
    assert run.files_left() == []  # no socket directory
    assert scenarios.lasting_shm_segments(before=run.shm_before) == []


def test_worker_spans_join_the_steps_trace_with_their_rank(tiny_model_dir: str, tmp_path) -> None:
    from tracevllm.tracing.exporters import read_spans_jsonl

    _run_scenario("trace", tiny_model_dir, "1", str(tmp_path))
    spans = read_spans_jsonl(str(tmp_path / "spans.jsonl"))
    by_id = {s.span_id: s for s in spans}
    runs = [s for s in spans if s.name == "ModelRunner.execute_model"]
    assert runs
    for span in runs:
        assert span.process_kind == "worker"
        assert span.resource["tracevllm.rank"] == 0
        assert (span.resource["tracevllm.tp_rank"], span.resource["tracevllm.pp_rank"]) == (0, 0)
        parent = by_id[span.parent_span_id]  # the step, in EngineCore's process
        assert parent.name == "EngineCore.step" and parent.process_kind == "engine_core"
        assert parent.trace_id == span.trace_id and parent.pid != span.pid
