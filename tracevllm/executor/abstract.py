"""The executor: how EngineCore reaches the model runner.

Mirrors vllm/v1/executor/abstract.py (``Executor``) and uniproc_executor.py
(``UniProcExecutor``), with vllm/v1/worker/gpu_worker.py's ``Worker`` folded
in: one process, one device, so the executor owns the ``ModelRunner``
directly. Tensor parallelism would add a ``MultiprocExecutor`` that
broadcasts the same calls to one worker per rank; EngineCore would not change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracevllm.config import VllmConfig
from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput
from tracevllm.kv_cache_interface import KVCacheSpec
from tracevllm.outputs import DraftTokenIds, ModelRunnerOutput

if TYPE_CHECKING:
    from tracevllm.worker.model_runner import ModelRunner


class Executor:
    """Runs the model for EngineCore. One implementation for now: in-process."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self._init_executor()

    def _init_executor(self) -> None:
        raise NotImplementedError

    def determine_available_memory(self) -> int:
        """Bytes the KV cache may take (vLLM profiles the device; on CPU it is a
        configured budget, as vLLM's VLLM_CPU_KVCACHE_SPACE)."""
        return self.vllm_config.cache_config.kv_cache_memory_bytes

    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:
        """Each worker's KV cache specs, by layer name (one worker here)."""
        raise NotImplementedError

    def initialize_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        raise NotImplementedError

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        raise NotImplementedError

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (speculative decoding)."""
        raise NotImplementedError

    def drop_all_requests(self) -> None:
        """Forget every request (after a failed in-process step)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    """The model runner in this process (vLLM's UniProcExecutor + Worker)."""

    def _init_executor(self) -> None:
        from tracevllm.worker.model_runner import ModelRunner

        self.init_device()
        self.model_runner: ModelRunner = ModelRunner(self.vllm_config)
        self.model_runner.load_model()

    def init_device(self) -> None:
        """vLLM's Worker.init_device: threads, the allocator, and the engine seed.

        Threads and allocator: see platforms/cpu.py. The seed makes requests
        without their own ``seed`` reproducible from run to run (they draw
        from the global generator).
        """
        import random

        import numpy as np
        import torch

        from tracevllm.platforms import cpu

        if self.vllm_config.device_config.device == "cpu":
            cpu.tune_malloc()
        threads = cpu.engine_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        seed = self.vllm_config.model_config.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:
        return [self.model_runner.get_kv_cache_spec()]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        # None: the forward ran and sample_tokens() will finish the step (vLLM
        # splits the two so the scheduler can build the grammar bitmask in between).
        # An output here: nothing was scheduled, there is nothing to sample.
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.model_runner.take_draft_token_ids()

    def drop_all_requests(self) -> None:
        self.model_runner.drop_all_requests()
