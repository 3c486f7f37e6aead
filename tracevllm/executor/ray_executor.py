"""One Ray actor per rank, on one machine or several.

Mirrors vllm/v1/executor/ray_executor.py (``RayDistributedExecutor``).
``initialize_ray_cluster`` joins (or starts) Ray and reserves a placement
group of one CPU bundle per rank; each rank is an actor running a
``RayWorkerWrapper`` in its bundle. The actors are renumbered so the driver's
node comes first, then meet through torch.distributed at a ``tcp://``
address on the driver's node (the loopback when every rank is on it): Ray
only places and drives the workers, every collective is torch.distributed's
(gloo on CPU). ``collective_rpc`` is one actor call per rank; a step is
vLLM's split: ``execute_model`` keeps the scheduler output and
``sample_tokens`` runs the forward and the sampling on every rank in one call
(``RayWorkerWrapper.execute_model_ray``), the output rank's answer returned.

Departures: plain actor calls where vLLM builds a Ray compiled graph (its
PP stages then hand tensors over Ray's channels; here torch.distributed's
send/recv between the ranks carries them, as with ``"mp"``); the TRACEVLLM_*
variables reach the workers in the actors' runtime environment (vLLM: an
``update_environment_variables`` call); ``shutdown`` kills the actors and
removes the placement group this executor made (vLLM leaves both to Ray);
each call carries the step's trace context. Left out: KV connectors,
nsight, ``VLLM_RAY_BUNDLE_INDICES``, elastic expert parallelism.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tracevllm import envs, tracing
from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput
from tracevllm.executor.abstract import Executor
from tracevllm.executor.ray_utils import (
    FutureWrapper,
    RayWorkerWrapper,
    get_env_vars_to_copy,
    get_results,
    initialize_ray_cluster,
    release_ray_cluster,
)
from tracevllm.logger import init_logger
from tracevllm.outputs import DraftTokenIds, ModelRunnerOutput
from tracevllm.utils.network_utils import get_distributed_init_method, get_ip, get_open_port

logger = init_logger(__name__)

COMPLETED_NONE_FUTURE: Future[ModelRunnerOutput | None] = Future()
COMPLETED_NONE_FUTURE.set_result(None)


@dataclass
class RayWorkerMetaData:
    """An actor, the rank it was made with, and the rank it gets once sorted."""

    worker: Any  # ray.actor.ActorHandle
    created_rank: int
    adjusted_rank: int = -1
    ip: str = ""
    node_id: str = ""


class RayDistributedExecutor(Executor):
    """Ray-based distributed executor"""

    uses_ray: bool = True
    supports_pp: bool = True

    # --8<-- [start:init_executor]
    def _init_executor(self) -> None:
        self.workers: list[Any] = []
        self._shutdown_lock = threading.Lock()
        self.shutting_down = False
        # Made here (removed at shutdown), or the caller's own (kept).
        self._owns_placement_group = self.parallel_config.placement_group is None
        initialize_ray_cluster(self.parallel_config)
        # Stop the actors at exit, even if nobody calls shutdown().
        self._finalizer = weakref.finalize(self, self.shutdown)
        try:
            self._init_workers_ray(self.parallel_config.placement_group)
        except BaseException:
            self.shutdown()
            raise
        # What execute_model() keeps for sample_tokens().
        self.scheduler_output: SchedulerOutput | None = None
        self.output_rank = (
            self.parallel_config.world_size - self.parallel_config.tensor_parallel_size
        )

    # --8<-- [end:init_executor]

    # --8<-- [start:init_workers_ray]
    def _init_workers_ray(self, placement_group: Any) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size = self.parallel_config.world_size
        bundle_indices = [
            i for i, bundle in enumerate(placement_group.bundle_specs) if bundle.get("CPU", 0)
        ][:world_size]
        # Actors start in their node's raylet's environment, not this process's.
        runtime_env = {"env_vars": get_env_vars_to_copy()}
        metadata: list[RayWorkerMetaData] = []
        for rank, bundle_id in enumerate(bundle_indices):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_capture_child_tasks=True,
                placement_group_bundle_index=bundle_id,
            )
            worker = ray.remote(num_cpus=1, scheduling_strategy=strategy, runtime_env=runtime_env)(
                RayWorkerWrapper
            ).remote(rpc_rank=rank)
            metadata.append(RayWorkerMetaData(worker=worker, created_rank=rank))
        self.workers = [m.worker for m in metadata]

        ips = ray.get([m.worker.get_node_ip.remote() for m in metadata])
        nodes = ray.get([m.worker.get_node_and_gpu_ids.remote() for m in metadata])
        for m, ip, (node_id, _) in zip(metadata, ips, nodes, strict=True):
            m.ip, m.node_id = ip, node_id
        driver_node_id = ray.get_runtime_context().get_node_id()
        per_node: dict[str, int] = {}
        for m in metadata:
            per_node[m.node_id] = per_node.get(m.node_id, 0) + 1

        # The driver's node first (its rank 0 hosts the rendezvous), then the
        # nodes with fewer workers, so each node's ranks are neighbours (vLLM
        # sorts by IP; by node id here, so two Ray nodes on one machine work).
        def sort_key(m: RayWorkerMetaData) -> tuple[int, int, str]:
            return (0 if m.node_id == driver_node_id else 1, per_node[m.node_id], m.node_id)

        metadata.sort(key=sort_key)
        for i, m in enumerate(metadata):
            m.adjusted_rank = i
        self.workers = [m.worker for m in metadata]
        self.collective_rpc(
            "adjust_rank", args=({m.created_rank: i for i, m in enumerate(metadata)},)
        )

        # Every rank on this machine: the loopback always works. Else the
        # address the other machines reach this one by (TRACEVLLM_HOST_IP).
        driver_ip = get_ip()
        if all(m.ip == driver_ip for m in metadata):
            driver_ip = "127.0.0.1"
        distributed_init_method = get_distributed_init_method(driver_ip, get_open_port())
        tp_size = self.parallel_config.tensor_parallel_size
        node_ranks: dict[str, list[int]] = {}
        all_kwargs = []
        for rank, m in enumerate(metadata):
            node_ranks.setdefault(m.node_id, []).append(rank)
            all_kwargs.append(
                dict(
                    vllm_config=self.vllm_config,
                    local_rank=len(node_ranks[m.node_id]) - 1,  # its index on its node
                    rank=rank,
                    distributed_init_method=distributed_init_method,
                    is_driver_worker=rank % tp_size == 0,
                )
            )
        self.collective_rpc("init_worker", args=(all_kwargs,))
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    # --8<-- [end:init_workers_ray]

    @property
    def max_concurrent_batches(self) -> int:
        pp_size = self.parallel_config.pipeline_parallel_size
        async_scheduling = getattr(self.scheduler_config, "async_scheduling", False)
        return 2 if pp_size <= 1 and async_scheduling else pp_size

    # --8<-- [start:collective_rpc]
    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> list[Any] | Future[list[Any]]:
        """Every actor runs ``method`` (a function is sent by Ray's cloudpickle);
        their results in rank order."""
        if self.shutting_down:
            raise RuntimeError("Executor failed: it was shut down")
        refs = [w.execute_method.remote(method, *args, **(kwargs or {})) for w in self.workers]
        if non_block:
            return FutureWrapper(refs)
        return get_results(refs, timeout=timeout)  # type: ignore[no-any-return]

    # --8<-- [end:collective_rpc]

    # --8<-- [start:execute_model]
    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        if self.scheduler_output is not None:
            raise RuntimeError(
                "State error: sample_tokens() must be called after execute_model() returns None."
            )
        if not scheduler_output.total_num_scheduled_tokens:
            # Nothing to run: the runner only updates its state, right away.
            return self._execute_step(scheduler_output, None, non_block)
        # The forward runs with the sampling, once the grammar bitmask is known.
        self.scheduler_output = scheduler_output
        return COMPLETED_NONE_FUTURE if non_block else None

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        scheduler_output, self.scheduler_output = self.scheduler_output, None
        if scheduler_output is None:
            return COMPLETED_NONE_FUTURE if non_block else None
        return self._execute_step(scheduler_output, grammar_output, non_block)

    def _execute_step(
        self,
        scheduler_output: SchedulerOutput,
        grammar_output: GrammarOutput | None,
        non_block: bool,
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        """The step on every rank at once; the output rank's answer."""
        if self.shutting_down:
            raise RuntimeError("Executor failed: it was shut down")
        trace_headers = tracing.inject_trace_context() if tracing.is_enabled() else None
        refs = [
            w.execute_model_ray.remote((scheduler_output, grammar_output), trace_headers)
            for w in self.workers
        ]
        future = FutureWrapper(refs, wanted=self.output_rank)
        if non_block:
            return future
        return future.result(timeout=envs.TRACEVLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)  # type: ignore[no-any-return]

    # --8<-- [end:execute_model]

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        refs = [w.execute_method.remote("take_draft_token_ids") for w in self.workers]
        return get_results(refs, wanted=self.output_rank)  # type: ignore[no-any-return]

    def check_health(self) -> None:
        # Every actor answers within 10 s, or the error says which did not.
        self.collective_rpc("check_health", timeout=10)

    # --8<-- [start:shutdown]
    def shutdown(self) -> None:
        """Kill the actors, remove the placement group made for them, and let
        go of Ray (idempotent)."""
        with self._shutdown_lock:
            first, self.shutting_down = not self.shutting_down, True
        if not first:
            return
        logger.info("Shutting down Ray distributed executor.")
        import ray

        if ray.is_initialized():
            # Each rank drops its groups and flushes its spans first (a few
            # seconds at most: a stuck or dead rank is killed all the same).
            done = [w.shutdown.remote() for w in self.workers]
            ray.wait(done, num_returns=len(done), timeout=5)
            for worker in self.workers:
                ray.kill(worker)
            placement_group = self.parallel_config.placement_group
            if self._owns_placement_group and placement_group is not None:
                ray.util.remove_placement_group(placement_group)
                self.parallel_config.placement_group = None
        self.workers = []
        release_ray_cluster()

    # --8<-- [end:shutdown]
