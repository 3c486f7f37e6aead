"""The executor: how EngineCore reaches the workers, one per rank.

Mirrors vllm/v1/executor/abstract.py (``Executor``, ``Executor.get_class``).
EngineCore calls the executor; the executor calls the same method on every
worker (``collective_rpc``) and hands back one answer. ``UniProcExecutor``
runs the one worker in EngineCore's process; ``MultiprocExecutor`` one
process per rank; ``RayDistributedExecutor`` one Ray actor per rank. Left
out: KV connector output aggregation, LoRA, sleep/wake, profiling,
elastic scaling and the external launcher.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, overload

from tracevllm.config import VllmConfig
from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput
from tracevllm.kv_cache_interface import KVCacheConfig, KVCacheSpec
from tracevllm.outputs import DraftTokenIds, ModelRunnerOutput

FailureCallback = Callable[[], None]


class Executor:
    """Runs the model for EngineCore, on one worker or many."""

    uses_ray: bool = False  # whether the executor uses Ray for orchestration
    supports_pp: bool = False  # whether the executor supports pipeline parallelism

    # --8<-- [start:get_class]
    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
        """The executor ``distributed_executor_backend`` names (ParallelConfig
        has already turned None into "uni" or "mp")."""
        backend = vllm_config.parallel_config.distributed_executor_backend
        executor_class: type[Executor]
        if isinstance(backend, type):
            if not issubclass(backend, Executor):
                raise TypeError(
                    f"distributed_executor_backend must be a subclass of Executor. Got {backend}."
                )
            executor_class = backend
        elif backend == "ray":
            from tracevllm.executor.ray_executor import RayDistributedExecutor

            executor_class = RayDistributedExecutor
        elif backend == "mp":
            from tracevllm.executor.multiproc_executor import MultiprocExecutor

            executor_class = MultiprocExecutor
        elif backend == "uni":
            from tracevllm.executor.uniproc_executor import UniProcExecutor

            executor_class = UniProcExecutor
        elif isinstance(backend, str):
            executor_class = _resolve_obj_by_qualname(backend)
            if not (isinstance(executor_class, type) and issubclass(executor_class, Executor)):
                raise TypeError(
                    "distributed_executor_backend must be a subclass of Executor. "
                    f"Got {executor_class}."
                )
        else:
            raise ValueError(f"Unknown distributed executor backend: {backend}")
        return executor_class

    # --8<-- [end:get_class]

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.parallel_config = vllm_config.parallel_config
        self.scheduler_config = vllm_config.scheduler_config
        self.device_config = vllm_config.device_config
        self.speculative_config = vllm_config.speculative_config
        self.observability_config = vllm_config.observability_config
        self._init_executor()

    def _init_executor(self) -> None:
        raise NotImplementedError

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        """Allocate every worker's KV cache (each takes its own config), then
        warm the workers up."""
        self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))
        self.collective_rpc("compile_or_warm_up_model")

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback`` if the executor fails for good (a worker died)."""

    def determine_available_memory(self) -> list[int]:
        """Bytes each worker's KV cache may take."""
        return self.collective_rpc("determine_available_memory")

    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:
        """Each worker's KV cache specs, by layer name."""
        return self.collective_rpc("get_kv_cache_spec")

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> Any:
        """Call ``method`` on every worker; a list of their results, in rank order.

        ``method`` is a ``Worker`` method's name, or a function called as
        ``method(worker, *args, **kwargs)``. ``timeout`` (seconds) raises
        ``TimeoutError``; ``non_block`` returns a Future of the list.
        """
        raise NotImplementedError

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[False] = False
    ) -> ModelRunnerOutput | None: ...

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput | None]: ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        output = self.collective_rpc("execute_model", args=(scheduler_output,), non_block=non_block)
        return output[0]  # type: ignore[no-any-return]

    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: Literal[False] = False
    ) -> ModelRunnerOutput: ...

    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput]: ...

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        output = self.collective_rpc("sample_tokens", args=(grammar_output,), non_block=non_block)
        return output[0]  # type: ignore[no-any-return]

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (speculative decoding)."""
        output: list[DraftTokenIds | None] = self.collective_rpc("take_draft_token_ids")
        return output[0]

    def drop_all_requests(self) -> None:
        """Forget every request (tracevllm's: after a failed in-process step)."""
        self.collective_rpc("drop_all_requests")

    @property
    def max_concurrent_batches(self) -> int:
        return 1

    def check_health(self) -> None:
        """Raise if the executor is not healthy."""
        raise NotImplementedError

    def shutdown(self) -> None:
        self.collective_rpc("shutdown")

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return False


def _resolve_obj_by_qualname(qualname: str) -> Any:
    """``"package.module.Name"`` -> the object (vllm/utils/import_utils.py)."""
    import importlib

    module_name, obj_name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), obj_name)


# vLLM keeps this name here too, for code that imported it from abstract.py.
from tracevllm.executor.uniproc_executor import UniProcExecutor  # noqa: E402

__all__ = ["Executor", "FailureCallback", "UniProcExecutor"]
