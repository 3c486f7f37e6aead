"""Ray helpers for the ``"ray"`` executor backend.

Mirrors vllm/v1/executor/ray_utils.py: ``ray_is_available``,
``assert_ray_available``, ``RayWorkerWrapper`` (the class each Ray actor
runs: a ``WorkerWrapperBase`` that also answers where it lives and runs a
whole step), ``FutureWrapper`` (a step's answer as a Future) and
``initialize_ray_cluster`` (connect to or start Ray, then reserve one bundle
per rank in a placement group).

Departures: a bundle is one CPU (vLLM's CPU platform has no Ray backend;
its bundles are one GPU each); with no cluster to join, the Ray instance
started here gets at least one CPU per rank (more ranks than CPUs take turns,
as with ``"mp"``), and the last executor using it shuts it down; a step
waits on every rank's answer as it comes, so a rank that fails or dies is
an error at once rather than the output rank hanging in a collective. Ray is
an optional extra: nothing here imports it until a Ray executor is made.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tracevllm import tracing
from tracevllm.logger import init_logger
from tracevllm.serial_utils import run_method
from tracevllm.tracing.ranks import worker_resource_attributes
from tracevllm.utils.network_utils import get_ip
from tracevllm.worker.worker_base import WorkerWrapperBase

if TYPE_CHECKING:
    from tracevllm.config import ParallelConfig
    from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput
    from tracevllm.outputs import ModelRunnerOutput

logger = init_logger(__name__)

# How long to wait for a placement group's resources (vLLM's).
PG_WAIT_TIMEOUT = 1800

# Each node's own: never copied from the driver to the workers (vLLM's list, renamed).
WORKER_SPECIFIC_ENV_VARS: set[str] = {"TRACEVLLM_HOST_IP", "CUDA_VISIBLE_DEVICES"}


def ray_is_available() -> bool:
    """Whether Ray can be imported (without importing it)."""
    return importlib.util.find_spec("ray") is not None


def assert_ray_available() -> None:
    """vLLM's error when the ``"ray"`` backend is asked for without Ray."""
    if not ray_is_available():
        raise ValueError(
            "Failed to import Ray: No module named 'ray'. "
            "Please install Ray with `pip install ray` (tracevllm: `pip install -e .[ray]`)."
        )


def get_env_vars_to_copy() -> dict[str, str]:
    """The driver's TRACEVLLM_* settings, for workers that Ray starts elsewhere
    (an actor inherits the environment of its node's raylet, not the driver's)."""
    return {
        name: value
        for name, value in os.environ.items()
        if name.startswith("TRACEVLLM_") and name not in WORKER_SPECIFIC_ENV_VARS
    }


# --8<-- [start:ray_worker_wrapper]
class RayWorkerWrapper(WorkerWrapperBase):
    """What each Ray actor runs: one rank's worker, made once ranks are known.

    The executor makes the actors first (``rpc_rank`` in creation order),
    asks where each landed, renumbers them so the ranks on the driver's node
    come first (``adjust_rank``), and only then builds the workers
    (``init_worker``), so rank 0, which hosts torch.distributed's rendezvous,
    is on the driver's node.
    """

    def adjust_rank(self, rank_mapping: dict[int, int]) -> None:
        if self.rpc_rank in rank_mapping:
            self.rpc_rank = self.global_rank = rank_mapping[self.rpc_rank]

    def init_worker(self, all_kwargs: list[dict[str, Any]]) -> None:
        super().init_worker(all_kwargs)
        # This rank's own TracerProvider, as a worker process of "mp" has.
        tracing.init_tracer(
            "worker",
            self.vllm_config.trace_config,
            self.vllm_config.observability_config,
            resource_attributes=worker_resource_attributes(
                self.vllm_config, all_kwargs[self.rpc_rank]["rank"]
            ),
        )

    def execute_method(self, method: str | Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return run_method(self, method, args, kwargs)
        except Exception:
            # The other ranks may now wait on this one in a collective.
            logger.exception(
                "Error executing method %r. This might cause deadlock in distributed execution.",
                method,
            )
            raise

    def get_node_ip(self) -> str:
        return get_ip()

    def get_node_and_gpu_ids(self) -> tuple[str, list[int]]:
        """This actor's Ray node and the GPUs Ray gave it (none on CPU)."""
        import ray

        context = ray.get_runtime_context()
        gpu_ids = context.get_accelerator_ids().get("GPU", [])
        return context.get_node_id(), [int(x) for x in gpu_ids]

    def override_env_vars(self, vars: dict[str, str]) -> None:
        os.environ.update(vars)

    def execute_model_ray(
        self,
        execute_model_input: tuple[SchedulerOutput, GrammarOutput | None],
        trace_headers: dict[str, str] | None = None,
    ) -> ModelRunnerOutput | None:
        """A whole step on this rank: the forward, then the sampling (vLLM
        runs this in its compiled graph; here it is one actor call per rank).
        The step's trace context comes along, so this rank's spans join it."""
        from tracevllm.distributed.parallel_state import send_pp_stage_failure

        assert self.worker is not None, "Worker is not initialized"
        scheduler_output, grammar_output = execute_model_input
        with tracing.trace_context(trace_headers):
            try:
                output = self.worker.execute_model(scheduler_output)  # type: ignore[attr-defined]
            except Exception as e:
                if scheduler_output.total_num_scheduled_tokens:
                    # The next pipeline stage waits for this step's tensors.
                    send_pp_stage_failure(self.rpc_rank, e)
                raise
            if output is None:
                output = self.worker.sample_tokens(grammar_output)  # type: ignore[attr-defined]
        return output  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        from tracevllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        # The spans first: the executor kills a worker that has not stopped
        # within 5 s (RayDistributedExecutor.shutdown).
        tracing.flush_tracer()
        super().shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()
        tracing.shutdown_tracer()


# --8<-- [end:ray_worker_wrapper]


def get_results(refs: list[Any], timeout: float | None = None, wanted: int | None = None) -> Any:
    """Every rank's answer in rank order, or only rank ``wanted``'s.

    The answers are read as they come: one rank that fails (or whose actor
    died) raises at once, naming its rank, even while the rank asked for
    still waits for it in a collective.
    """
    import ray

    deadline = None if timeout is None else time.monotonic() + timeout
    index = {ref: rank for rank, ref in enumerate(refs)}
    pending = list(refs)
    while pending and not (wanted is not None and refs[wanted] not in pending):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left, fetch_local=False)
        if not ready:
            raise TimeoutError(f"Ray workers did not answer within {timeout} s.")
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(
                    f"Executor failed: the Ray worker of rank {index[ref]} died ({e})."
                ) from e
    if wanted is not None:
        return ray.get(refs[wanted])
    return ray.get(refs)


class FutureWrapper(Future):  # type: ignore[type-arg]
    """Ray's answers to one call, as the Future EngineCore waits on: rank
    ``wanted``'s answer (a step), or the list of all (``collective_rpc``)."""

    def __init__(self, refs: list[Any], wanted: int | None = None) -> None:
        super().__init__()
        self.refs = refs
        self.wanted = wanted

    def done(self) -> bool:
        import ray

        refs = self.refs if self.wanted is None else [self.refs[self.wanted]]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return len(ready) == len(refs)

    def result(self, timeout: float | None = None) -> Any:
        return get_results(self.refs, timeout=timeout, wanted=self.wanted)


# --- the cluster -----------------------------------------------------------------
# A Ray instance this process started is shut down with the last executor
# that used it; one it joined (or the user's own) is left alone.
_cluster_lock = threading.Lock()
_started_here = False
_users = 0


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """Keep this process's own SIGTERM handler across ``ray.init``.

    ``ray.init`` swaps in one that exits at once (and Ray's core worker a C++
    one that logs the signal and re-raises it). EngineCore's handler turns the
    first SIGTERM or SIGINT into an orderly exit and ignores the next: on
    Ctrl-C the engine gets SIGINT from the terminal and SIGTERM from the
    frontend a moment later, and Ray's handler would cut ``ray.shutdown()``
    short. The processes Ray started share its fate through the kernel (they
    are killed with it), except the raylet's two agents: they find the raylet
    gone, report it to the dead GCS for a minute, and only then exit. A
    process with no handler of its own (a script) keeps Ray's, which exits
    through ``atexit`` and so through ``ray.shutdown()``.
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    try:
        yield
    finally:
        if callable(handler):
            signal.signal(signal.SIGTERM, handler)


def _connect_or_start_ray(parallel_config: ParallelConfig, ray_address: str | None) -> None:
    with _keep_sigterm_handler():
        _ray_init(parallel_config, ray_address)


def _ray_init(parallel_config: ParallelConfig, ray_address: str | None) -> None:
    import ray

    global _started_here, _users
    if ray.is_initialized():
        logger.info("Ray is already initialized. Skipping Ray initialization.")
    elif ray_address is not None or os.environ.get("RAY_ADDRESS"):
        ray.init(address=ray_address)  # Ray reads RAY_ADDRESS itself
    else:
        try:
            # A cluster `ray start` made on this machine, as vLLM's ray.init() finds it.
            ray.init(address="auto")
        except ConnectionError:
            from tracevllm.config import available_cpu_count

            logger.info("No existing Ray cluster found: starting one on this machine.")
            # The machine's CPUs, and at least one a rank: the placement group
            # wants a bundle of one CPU each (more ranks than CPUs take turns).
            num_cpus = max(available_cpu_count(), parallel_config.world_size)
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
            _started_here = True
    if _started_here:
        _users += 1


def release_ray_cluster() -> None:
    """An executor is done with Ray: shut down the instance this process
    started once nobody uses it (a joined cluster keeps running)."""
    global _started_here, _users
    with _cluster_lock:
        if not _started_here:
            return
        _users -= 1
        if _users > 0:
            return
        _started_here = False
    import ray

    agents = _ray_agents()
    ray.shutdown()
    # ray.shutdown() stops the processes Ray started itself (raylet, GCS ...)
    # but not the agents raylet started (RuntimeEnvAgent ...): they leave on
    # their own once they notice, which on a loaded machine took over 30 s.
    for pid in agents:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _ray_agents() -> list[int]:
    """The children of the Ray processes this process started (Linux /proc;
    none elsewhere, or if Ray's internals moved)."""
    try:
        import ray

        node: Any = ray._private.worker._global_node
        parents = {info.process.pid for infos in node.all_processes.values() for info in infos}
    except Exception:
        return []
    children = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": the name may hold spaces.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid in parents:
            children.append(int(entry))
    return children


# --8<-- [start:initialize_ray_cluster]
def initialize_ray_cluster(parallel_config: ParallelConfig, ray_address: str | None = None) -> None:
    """Connect to Ray and reserve the workers' place: one bundle of one CPU
    per rank, the first on this (the driver's) node.

    Joins ``ray_address`` (or ``RAY_ADDRESS``, or a cluster ``ray start``
    made on this machine), else starts Ray here. Uses the placement group in
    ``parallel_config`` (or the one this process runs in) if there is one;
    else makes one and waits for it. Sets ``parallel_config.placement_group``.
    """
    assert_ray_available()
    if os.environ.get("RAY_USAGE_STATS_ENABLED", "0") != "1":
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    with _cluster_lock:
        _connect_or_start_ray(parallel_config, ray_address)
    try:
        _reserve_placement_group(parallel_config)
    except BaseException:
        release_ray_cluster()
        raise


# --8<-- [end:initialize_ray_cluster]


def _reserve_placement_group(parallel_config: ParallelConfig) -> None:
    import ray

    world_size = parallel_config.world_size
    current_placement_group = (
        parallel_config.placement_group or ray.util.get_current_placement_group()
    )
    if current_placement_group:
        logger.info("Using the existing placement group")
        cpu_bundles = sum(1 for b in current_placement_group.bundle_specs if b.get("CPU", 0))
        if world_size > cpu_bundles:
            raise ValueError(
                "The number of required CPUs exceeds the total number of available CPUs "
                f"in the placement group. Required number of devices: {world_size}. "
                f"Total number of devices: {cpu_bundles}."
            )
        _verify_bundles(current_placement_group, parallel_config)
    else:
        logger.info("No current placement group found. Creating a new placement group.")
        if world_size > ray.cluster_resources().get("CPU", 0):
            logger.warning(
                "The number of required CPUs exceeds the total number of available CPUs "
                "in the placement group."
            )
        specs: list[dict[str, float]] = [{"CPU": 1.0} for _ in range(world_size)]
        # Bundle 0 on the driver's node: rank 0 hosts the rendezvous at its address.
        specs[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001
        current_placement_group = ray.util.placement_group(specs, strategy="PACK")
        try:
            _wait_until_pg_ready(current_placement_group)
            _verify_bundles(current_placement_group, parallel_config)
        except BaseException:
            ray.util.remove_placement_group(current_placement_group)
            raise
    parallel_config.placement_group = current_placement_group


def _wait_until_pg_ready(placement_group: Any) -> None:
    """Wait for the bundles, saying every so often what is awaited (vLLM's)."""
    import ray

    start = time.time()
    ready_ref = placement_group.ready()
    wait_interval = 10
    while time.time() - start < PG_WAIT_TIMEOUT:
        ready, _ = ray.wait([ready_ref], timeout=wait_interval)
        if ready:
            return
        wait_interval *= 2
        logger.info(
            "Waiting for creating a placement group of specs for %d seconds. specs=%s. "
            "Check `ray status` and `ray list nodes` to see if you have enough resources, "
            "and make sure the IP addresses used by ray cluster are the same as "
            "TRACEVLLM_HOST_IP environment variable specified in each node if you are "
            "running on a multi-node.",
            int(time.time() - start),
            placement_group.bundle_specs,
        )
    raise ValueError(
        f"Cannot provide a placement group of placement_group_specs="
        f"{placement_group.bundle_specs} within {PG_WAIT_TIMEOUT} seconds. See "
        "`ray status` and `ray list nodes` to make sure the cluster has enough resources."
    )


def _verify_bundles(placement_group: Any, parallel_config: ParallelConfig) -> None:
    """The driver's node must hold a bundle; a TP group split over nodes is a warning."""
    import ray
    from ray.util import placement_group_table

    bundle_to_node = placement_group_table(placement_group)["bundles_to_node_id"]
    node_bundles: dict[str, int] = defaultdict(int)
    for node_id in bundle_to_node.values():
        node_bundles[node_id] += 1
    driver_node_id = ray.get_runtime_context().get_node_id()
    if driver_node_id not in node_bundles:
        raise RuntimeError(
            f"driver node id {driver_node_id} is not included in a placement group "
            f"{placement_group.id}. Node id -> bundles {dict(node_bundles)}. "
            "Check `ray status` and `ray list nodes` to see if this node has free CPUs "
            "before starting a tracevllm engine."
        )
    tp_size = parallel_config.tensor_parallel_size
    for node_id, bundles in node_bundles.items():
        if bundles < tp_size:
            logger.warning(
                "tensor_parallel_size=%d is bigger than a reserved number of CPUs (%d CPUs) "
                "in a node %s. Tensor parallel workers can be spread out to 2+ nodes, "
                "each all-reduce then crossing the network.",
                tp_size,
                bundles,
                node_id,
            )
