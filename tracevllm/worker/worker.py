"""The worker: one rank's device, model shard and KV cache, around its ModelRunner.

Mirrors vllm/v1/worker/gpu_worker.py (``Worker``; with vllm/v1/worker/
cpu_worker.py's CPU threads folded in). The executor calls these methods on
every rank, by name, through ``collective_rpc``; the ``ModelRunner`` does the
work. With pipeline parallelism ``execute_model`` receives the previous
stage's ``IntermediateTensors`` and sends its own on. Left out: sleep/wake,
profiling, LoRA, weight transfer, memory profiling (the KV cache budget is
configured, as vLLM's CPU backend's ``VLLM_CPU_KVCACHE_SPACE``), CUDA graph
capture and compilation.
"""

from __future__ import annotations

import random
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tracevllm.worker.cpu_threads import (
    AdaptiveThreadPolicy,
    format_probe,
    log_change,
    probe_at_warm_up,
    run_step,
)
from tracevllm.worker.worker_base import WorkerBase

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig
    from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput
    from tracevllm.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from tracevllm.model_executor.models.interfaces_base import VllmModelForTextGeneration
    from tracevllm.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput
    from tracevllm.worker.model_runner import ModelRunner


class Worker(WorkerBase):
    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        # The CPU thread count's policy when it adapts (worker/cpu_threads.py).
        self.thread_policy: AdaptiveThreadPolicy | None = None
        self.warm_up_probe_steps = 0  # the timed dummy steps of its first probe
        # Whether this worker counts in _PROCESS_THREADS (init_device ran).
        self.num_threads_at_init: int | None = None

    # --8<-- [start:init_device]
    def init_device(self) -> None:
        """The device, this rank's threads, the process groups, the seed, the runner.

        On CPU the ranks share the machine's cores: each takes its share
        (vLLM's OMPProcessManager), and at least one thread. One rank with no
        count set adapts its count between steps (worker/cpu_threads.py).
        """
        from tracevllm.distributed.parallel_state import init_worker_distributed_environment
        from tracevllm.platforms import cpu
        from tracevllm.worker.model_runner import ModelRunner

        if self.device_config.device.startswith("cuda"):
            self.device = torch.device(f"cuda:{self.local_rank}")
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            cpu.tune_malloc()
        self.num_threads_at_init = claim_process_threads()
        threads = cpu.engine_num_threads(self.parallel_config.world_size)
        if threads is not None:
            torch.set_num_threads(threads)
        elif self.device.type == "cpu" and cpu.adaptive_threads(self.parallel_config.world_size):
            # Nothing fixed the count: it follows the machine's load, step by step.
            self.thread_policy = AdaptiveThreadPolicy(torch.get_num_threads(), on_change=log_change)
        # Even a world of one: the model's layers always ask the groups.
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank
        )
        set_random_seed(self.model_config.seed)
        self.model_runner = ModelRunner(self.vllm_config)

    # --8<-- [end:init_device]

    def get_cpu_threads(self) -> dict[str, Any]:
        """tracevllm's: this worker's thread count (the adaptive policy's
        choice, not a probe's count in passing), whether it adapts, and the
        changes the policy made, ``[old, new]`` in order, and its last probes,
        one line each (``cpu_threads.format_probe``: the pairs' time ratios and
        the decision) (for ``LLM.collective_rpc("get_cpu_threads")``; ``make
        bench`` records it)."""
        policy = self.thread_policy
        if policy is None:
            return {
                "threads": torch.get_num_threads(),
                "adaptive": False,
                "changes": [],
                "probes": 0,
                "probe_log": [],
            }
        return {
            "threads": policy.threads,
            "adaptive": True,
            "changes": [list(c) for c in policy.changes],
            "probes": policy.probes,
            "probe_log": [format_probe(r) for r in policy.probe_log],
        }

    def load_model(self) -> None:
        assert self.model_runner is not None, "init_device() first"
        self.model_runner.load_model()

    def get_model(self) -> VllmModelForTextGeneration:
        assert self.model_runner is not None and self.model_runner.model is not None
        return self.model_runner.model

    def determine_available_memory(self) -> int:
        """Bytes this rank's KV cache may take: the configured budget (vLLM
        profiles a GPU; its CPU worker returns VLLM_CPU_KVCACHE_SPACE too)."""
        return self.cache_config.kv_cache_memory_bytes

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_spec()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate this rank's KV cache: the block count every rank shares."""
        assert self.model_runner is not None
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        # The config names this rank's tensors: a pipeline stage's layers only.
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> None:
        """Capture the CUDA graphs, if any (the model compiled in load_model);
        with an adaptive CPU thread count, run its first probe on dummy
        steps; then the seed is set again, as vLLM does, so that loading the
        model leaves every rank's random state the same (a request without a
        seed samples alike on all)."""
        runner = self.model_runner
        assert runner is not None
        runner.capture_model()
        if self.thread_policy is not None:
            # tracevllm's: the thread count's first probe, on dummy steps
            # (cpu_threads.probe_at_warm_up), before any request waits on it.
            self.warm_up_probe_steps = probe_at_warm_up(
                self.thread_policy, runner._dummy_run, runner.max_num_tokens
            )
        set_random_seed(self.model_config.seed)

    # --8<-- [start:worker_execute_model]
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step's forward pass on this rank's layers.

        None: the forward ran and sample_tokens() will finish the step (vLLM
        splits the two so the scheduler can build the grammar bitmask in
        between). An output here: nothing was scheduled. With pipeline
        parallelism a stage after the first first receives the previous
        stage's ``IntermediateTensors``, and a stage before the last sends
        its own to the next (then it is done: only the last samples).
        """
        from tracevllm.distributed.parallel_state import get_pp_group
        from tracevllm.sequence import IntermediateTensors

        assert self.model_runner is not None
        pp_group = get_pp_group()
        intermediate_tensors = None
        forward_pass = scheduler_output.total_num_scheduled_tokens > 0
        if forward_pass and not pp_group.is_first_rank:
            # In step order: every stage runs the steps in the order they were sent.
            tensor_dict = pp_group.recv_tensor_dict()
            assert tensor_dict is not None
            intermediate_tensors = IntermediateTensors(tensor_dict)
        if self.thread_policy is not None and forward_pass:
            # At the thread count the policy picks, timed for it.
            output = run_step(
                self.thread_policy, self.model_runner.execute_model, scheduler_output,
                intermediate_tensors,
            )  # fmt: skip
        else:
            output = self.model_runner.execute_model(scheduler_output, intermediate_tensors)
        if not isinstance(output, IntermediateTensors):
            return output
        assert not pp_group.is_last_rank
        pp_group.send_tensor_dict(output.tensors)
        return None

    # --8<-- [end:worker_execute_model]

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample this step (an ``AsyncModelRunnerOutput`` with async scheduling)."""
        assert self.model_runner is not None
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        assert self.model_runner is not None
        return self.model_runner.take_draft_token_ids()

    def drop_all_requests(self) -> None:
        """Forget every request (tracevllm's: after a failed in-process step)."""
        if self.model_runner is not None:
            self.model_runner.drop_all_requests()

    def check_health(self) -> None:
        # A worker that answers is healthy (as vLLM's).
        return

    def shutdown(self) -> None:
        # vLLM's: the process's worker-side KV connector goes first (in a
        # worker process nothing else would shut it down: its NIXL agent,
        # side channel and registered memory).
        from tracevllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_shutdown,
        )

        try:
            ensure_kv_transfer_shutdown(self.vllm_config)
        finally:
            self.model_runner = None
            # tracevllm's: the count the process had, given back by the last
            # worker of the process to shut down (vLLM's CPU worker leaves its
            # OMP setting in place).
            if self.num_threads_at_init is not None:
                release_process_threads()
                self.num_threads_at_init = None


# The torch thread count a process had before its first live worker set its
# own, and how many workers are live in it: in-process engines share the
# user's process, and one may start while another runs (with that one's
# count set), so the count is given back when the last one shuts down.
_PROCESS_THREADS: dict[str, int] = {"live": 0, "before": 0}
_PROCESS_THREADS_LOCK = threading.Lock()


def claim_process_threads() -> int:
    """A worker starts: note the process's count if it is the first; returns it."""
    with _PROCESS_THREADS_LOCK:
        if _PROCESS_THREADS["live"] == 0:
            _PROCESS_THREADS["before"] = torch.get_num_threads()
        _PROCESS_THREADS["live"] += 1
        return _PROCESS_THREADS["before"]


def release_process_threads() -> None:
    """A worker shuts down: the last one gives the process its count back."""
    with _PROCESS_THREADS_LOCK:
        _PROCESS_THREADS["live"] -= 1
        if _PROCESS_THREADS["live"] == 0:
            torch.set_num_threads(_PROCESS_THREADS["before"])


def set_random_seed(seed: int) -> None:
    """Python's, NumPy's and torch's generators (vllm/utils/torch_utils.py).

    Requests without their own ``seed`` draw from torch's global generator,
    so an engine's outputs repeat from run to run.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
