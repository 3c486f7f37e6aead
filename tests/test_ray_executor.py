"""``distributed_executor_backend="ray"`` on a real local Ray cluster.

Ray's start-up is slow and leaves state in the process that starts it (a
connection, atexit hooks, a local cluster), so everything Ray runs in one
child process per module (``python -m tests.test_ray_executor``, under a
timeout), which prints one JSON line per engine for the tests to read: the
T = 1 reference; T = 2 with EngineCore in its own process starting Ray on
this machine (as `tracevllm serve` runs), traced; then P = 2 in this process
over a two-node ``ray.cluster_utils.Cluster`` joined by RAY_ADDRESS, as
across machines (placement, a worker's error, a killed rank, shutdown). All
with chunked prefill, prefix caching and preemption. The Ray tests are
skipped without Ray (``make setup-ray``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

from tests.test_pp_stage_failure import fail_next_forward
from tests.utils import run_json_lines

BLOCK_SIZE = 4
NUM_TOKENS = 24
# Lengths from one token to several chunks; the last two share a 20-token prefix.
PROMPT_LENS = [1, 5, 13, 30, 41, 20, 20, 27]


def _prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts[7] = prompts[6] + prompts[7][:7]
    return prompts


def _make_llm(model: str, **kw: Any) -> Any:
    from tracevllm import LLM

    return LLM(
        model=model,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,  # chunked prefill
        max_num_seqs=8,
        enable_prefix_caching=True,
        num_gpu_blocks_override=40,  # small: requests get preempted
        max_model_len=128,
        **kw,
    )


def _generate(llm: Any) -> dict[str, Any]:
    from tracevllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return dict(
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        cached=outs[7].num_cached_tokens,
        preemptions=llm.llm_engine.num_preemptions,
    )


# --- run on the actors by collective_rpc (module level: Ray pickles them) -------
def rank_and_pid(worker: Any) -> tuple[int, int]:
    return worker.rank, os.getpid()


def fail_on_purpose(worker: Any) -> None:
    raise ValueError(f"rank {worker.rank} says no")


def read_env(worker: Any, name: str) -> tuple[str | None, str | None]:
    """The variable in this actor, and in the runtime environment Ray gave it
    (a node's raylet started elsewhere has none of the driver's variables)."""
    import ray

    env_vars = ray.get_runtime_context().runtime_env.get("env_vars", {})
    return os.environ.get(name), env_vars.get(name)


# --- the child process ------------------------------------------------------------
def _ray_processes() -> list[str]:
    """This process's descendants that are Ray's (its cluster, its workers)."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "ray" in cmd or p.name().startswith("ray::"):
            found.append(f"{p.pid} {cmd[:120]}")
    return found


def _wait_gone(pids: list[int], timeout: float = 20) -> list[int]:
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def _engine_process(model: str) -> None:
    """T = 2 with EngineCore in its own process, as `tracevllm serve` runs it:
    it starts Ray on this machine, traces each rank's spans into the step's
    trace, and stops Ray again at shutdown."""
    trace_dir = tempfile.mkdtemp(prefix="tracevllm-ray-test-")
    try:
        llm = _make_llm(
            model, tensor_parallel_size=2, distributed_executor_backend="ray",
            trace_detail="request", trace_dir=trace_dir,
        )  # fmt: skip
        out = _generate(llm)
        llm.shutdown()
        out["worker_spans"] = _worker_spans(trace_dir)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    deadline = time.monotonic() + 20
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    out["ray_processes"] = _ray_processes()
    _say(engine="engine_process", **out)


def _worker_spans(trace_dir: str) -> dict[str, Any]:
    """Each rank's forward spans: its rank and stage, and whether each is a
    child of the step's span in EngineCore's process, in the step's trace."""
    from tracevllm.tracing.exporters import read_spans_jsonl

    spans = read_spans_jsonl(os.path.join(trace_dir, "spans.jsonl"))
    by_id = {s.span_id: s for s in spans}
    runs = [s for s in spans if s.name == "ModelRunner.execute_model"]
    joined = [
        (parent := by_id.get(s.parent_span_id)) is not None
        and parent.name.startswith("EngineCore.step")  # step_with_batch_queue under PP
        and parent.process_kind == "engine_core"
        and parent.trace_id == s.trace_id
        for s in runs
    ]
    return dict(
        ranks=sorted(
            {(s.resource["tracevllm.rank"], s.resource["tracevllm.pp_rank"]) for s in runs}
        ),
        kinds=sorted({s.process_kind for s in runs}),
        all_joined=bool(runs) and all(joined),
    )


def _two_nodes(model: str) -> None:
    """P = 2 over two Ray nodes (``ray.cluster_utils.Cluster``: two raylets on
    this machine, one CPU each) joined as across machines, by RAY_ADDRESS; one
    stage a node, two steps in flight (the batch queue). EngineCore is in this
    process, so its executor is at hand, and the cluster outlives it: shutdown
    must kill the actors and remove the placement group itself."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    from tracevllm.executor.ray_executor import RayDistributedExecutor

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1))
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
        os.environ["TRACEVLLM_RAY_TEST_MARK"] = "from-the-driver"
        llm = _make_llm(
            model, pipeline_parallel_size=2, distributed_executor_backend="ray",
            enable_multiprocessing=False,
        )  # fmt: skip
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        assert isinstance(executor, RayDistributedExecutor)
        out = _generate(llm)
        out["batches_in_flight"] = llm.llm_engine.engine_core.engine_core.max_batches_in_flight
        (table,) = placement_group_table().values()
        out["bundle_nodes"] = len(set(table["bundles_to_node_id"].values()))
        out["bundles"] = executor.parallel_config.placement_group.bundle_specs
        ranks = executor.collective_rpc(rank_and_pid)
        out["ranks"] = [r for r, _ in ranks]
        pids = [p for _, p in ranks]
        out["actor_pids_differ"] = len(set(pids)) == 2 and os.getpid() not in pids
        out["env"] = executor.collective_rpc(read_env, args=("TRACEVLLM_RAY_TEST_MARK",))
        try:
            executor.collective_rpc(fail_on_purpose)
            out["worker_error"] = None
        except Exception as e:
            out["worker_error"] = str(e)
        out["after_error"] = [r for r, _ in executor.collective_rpc(rank_and_pid)]
        # The first stage fails a step: the step fails naming it, within
        # seconds (the last stage is not left waiting for its tensors), and
        # the next generate gives the same tokens (the stages still in step).
        executor.collective_rpc(fail_next_forward, args=(0,))
        start = time.monotonic()
        try:
            _generate(llm)
            out["stage_error"] = None
        except Exception as e:
            out["stage_error"] = str(e)
        out["stage_waited"] = time.monotonic() - start
        out["tokens_after_stage_error"] = _generate(llm)["tokens"]
        # A killed rank: the next call says which, within seconds.
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        try:
            executor.check_health()
            out["dead_error"] = None
        except Exception as e:
            out["dead_error"] = str(e)
        out["dead_waited"] = time.monotonic() - start
        llm.shutdown()
        out["left"] = _wait_gone(pids)
        deadline = time.monotonic() + 20
        while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        out["cpus_free"] = ray.available_resources().get("CPU")
        out["pg_states"] = [t["state"] for t in placement_group_table().values()]
        # A cluster this engine joined stays up, and connected.
        out["cluster_kept"] = (
            ray.is_initialized() and len([n for n in ray.nodes() if n["Alive"]]) == 2
        )
        ray.shutdown()
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        cluster.shutdown()
    out["ray_processes"] = _ray_processes()
    _say(engine="two_nodes", **out)


def _main(model: str, *phases: str) -> None:
    llm = _make_llm(model, enable_multiprocessing=False)
    _say(engine="reference", **_generate(llm))
    llm.shutdown()
    for phase in phases or ("engine_process", "two_nodes"):
        globals()[f"_{phase}"](model)


# --- the tests -------------------------------------------------------------------
requires_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed (make setup-ray)"
)


def test_get_class_picks_the_ray_executor_without_importing_ray() -> None:
    # Ray is an optional extra: nothing imports it before a Ray executor is made.
    code = (
        "import sys, argparse\n"
        "from tracevllm.executor import Executor\n"
        "from tracevllm.executor.ray_executor import RayDistributedExecutor\n"
        "config = argparse.Namespace(parallel_config=argparse.Namespace(\n"
        "    distributed_executor_backend='ray'))\n"
        "assert Executor.get_class(config) is RayDistributedExecutor\n"
        "assert RayDistributedExecutor.uses_ray and RayDistributedExecutor.supports_pp\n"
        "print('ray' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_ray_backend_without_ray_is_vllms_error_even_where_ray_is_installed() -> None:
    # Ray hidden from the import system, as on an install without the extra.
    code = (
        "import sys\n"
        "sys.modules['ray'] = None\n"
        "from tracevllm.config import ParallelConfig\n"
        "try:\n"
        "    ParallelConfig(distributed_executor_backend='ray')\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Failed to import Ray" in proc.stdout and "pip install ray" in proc.stdout


def test_host_ip_variable_is_the_address_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from tracevllm.utils.network_utils import get_ip

    monkeypatch.setenv("TRACEVLLM_HOST_IP", "10.1.2.3")
    assert get_ip() == "10.1.2.3"
    monkeypatch.delenv("TRACEVLLM_HOST_IP")
    assert get_ip() != "10.1.2.3"


@pytest.fixture(scope="module")
def runs(tiny_model_dir: str) -> dict[str, dict[str, Any]]:
    lines = run_json_lines("tests.test_ray_executor", tiny_model_dir, timeout=420)
    return {line.pop("engine"): line for line in lines}


@requires_ray
def test_ray_tp2_and_pp2_give_the_single_worker_tokens(runs: dict[str, dict[str, Any]]) -> None:
    reference = runs["reference"]
    assert reference["preemptions"] > 0, "no request was preempted: make the pool smaller"
    assert reference["cached"] >= 16, "the shared prefix was not a cache hit"
    for engine in ("engine_process", "two_nodes"):
        out = runs[engine]
        differ = [i for i, (a, b) in enumerate(zip(out["tokens"], reference["tokens"])) if a != b]
        assert out["tokens"] == reference["tokens"], f"{engine}: prompts {differ} differ"
        assert out["preemptions"] > 0 and out["cached"] >= 16, engine


@requires_ray
def test_ray_places_one_actor_per_rank_one_stage_per_node(
    runs: dict[str, dict[str, Any]],
) -> None:
    out = runs["two_nodes"]
    assert out["ranks"] == [0, 1]
    assert out["actor_pids_differ"]
    # One CPU bundle per rank, the first pinned to the driver's node; one per node here.
    assert [b["CPU"] for b in out["bundles"]] == [1.0, 1.0]
    assert any(k.startswith("node:") for k in out["bundles"][0])
    assert out["bundle_nodes"] == 2
    assert out["batches_in_flight"] == 2  # P = 2: the batch queue fills the pipeline
    # The driver's TRACEVLLM_* settings reach the actors, in their runtime environment.
    assert out["env"] == [["from-the-driver"] * 2] * 2


@requires_ray
def test_ray_worker_spans_join_the_steps_trace(runs: dict[str, dict[str, Any]]) -> None:
    spans = runs["engine_process"]["worker_spans"]
    assert spans == dict(ranks=[[0, 0], [1, 0]], kinds=["worker"], all_joined=True)


@requires_ray
def test_ray_worker_error_and_dead_rank(runs: dict[str, dict[str, Any]]) -> None:
    out = runs["two_nodes"]
    assert out["worker_error"] is not None
    assert re.search("rank [01] says no", out["worker_error"]), out["worker_error"]
    assert out["after_error"] == [0, 1]
    assert out["stage_error"] is not None and "stage of rank 0 says no" in out["stage_error"]
    assert out["stage_waited"] < 10, out["stage_waited"]
    assert out["tokens_after_stage_error"] == out["tokens"]
    assert out["dead_error"] is not None, out
    assert "the Ray worker of rank 1 died" in out["dead_error"], out
    assert out["dead_waited"] < 10


@requires_ray
def test_ray_shutdown_leaves_nothing_behind(runs: dict[str, dict[str, Any]]) -> None:
    # A joined cluster: the actors gone, the placement group removed, the CPUs
    # free again, the cluster itself still up.
    out = runs["two_nodes"]
    assert out["left"] == [] and out["cpus_free"] == 2.0
    assert out["pg_states"] == ["REMOVED"]
    assert out["cluster_kept"]
    assert out["ray_processes"] == []
    # The Ray that EngineCore started for itself is stopped with it.
    assert runs["engine_process"]["ray_processes"] == []


if __name__ == "__main__":
    _main(*sys.argv[1:])
