"""What every worker is, and the wrapper an executor holds one through.

Mirrors vllm/v1/worker/worker_base.py (``WorkerBase``, ``WorkerWrapperBase``).
An executor never builds a ``Worker`` directly: it builds a
``WorkerWrapperBase`` that knows its rank, and ``init_worker`` makes the
worker from the keyword arguments of every rank (so a Ray actor, made before
ranks are known, is set up the same way as a process). Left out: worker
extension classes, ``worker_cls`` (the worker is always
tracevllm/worker/worker.py's), environment updates, the multimodal cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig
    from tracevllm.kv_cache_interface import KVCacheConfig


class WorkerBase:
    """One rank: a device, a model shard, its KV cache (the interface)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.parallel_config = vllm_config.parallel_config
        self.scheduler_config = vllm_config.scheduler_config
        self.device_config = vllm_config.device_config
        self.speculative_config = vllm_config.speculative_config
        self.observability_config = vllm_config.observability_config
        # Each worker's copy of the config knows its own rank.
        self.parallel_config.rank = rank
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker

    def init_device(self) -> None:
        raise NotImplementedError

    def load_model(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class WorkerWrapperBase:
    """Holds one worker; ``rpc_rank`` picks this worker's keyword arguments.

    Methods it does not have go to the worker (``__getattr__``), so an
    executor's ``collective_rpc("execute_model", ...)`` reaches
    ``Worker.execute_model``.
    """

    def __init__(self, rpc_rank: int = 0, global_rank: int | None = None) -> None:
        self.rpc_rank = rpc_rank
        self.global_rank = rpc_rank if global_rank is None else global_rank
        self.worker: WorkerBase | None = None

    def init_worker(self, all_kwargs: list[dict[str, Any]]) -> None:
        from tracevllm.worker.worker import Worker

        kwargs = dict(all_kwargs[self.rpc_rank])
        assert kwargs.get("vllm_config") is not None, "vllm_config is required"
        self.vllm_config: VllmConfig = kwargs["vllm_config"]
        self.worker = Worker(**kwargs)

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        """Every rank gets the whole list and takes its own (vLLM's)."""
        assert self.worker is not None
        self.worker.initialize_from_config(kv_cache_configs[self.global_rank])  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    def __getattr__(self, attr: str) -> Any:
        # Only reached for what the wrapper lacks; `worker` itself is set in __init__.
        worker = self.__dict__.get("worker")
        if worker is None:
            raise AttributeError(attr)
        return getattr(worker, attr)
