"""``CPUOffloadingSpec``: the CPU tier's size, its manager and its handlers.

Mirrors vllm/v1/kv_offload/cpu/spec.py. ``kv_connector_extra_config``
gives ``cpu_bytes_to_use`` (``--kv-offloading-size`` GiB, turned into bytes
by ``VllmConfig``); the tier holds as many whole blocks as fit:
``cpu_bytes_to_use // bytes per block`` (a block of every layer, the
engine's page size summed over its KV cache tensors). ``eviction_policy``
is vLLM's key (``lru``, the only one here). tracevllm adds ``cpu_offload_dir``:
a directory where the region is a memory-mapped file, so the tier can sit
on a disk (vLLM's region is an mmap too, of shared memory).

Left out: the ARC policy, ``store_threshold``, KV cache events, tensor and
pipeline parallelism (each rank would hold its own slice of every block:
refused, as the connector is).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from tracevllm.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingSpec,
)
from tracevllm.kv_offload.cpu.manager import CPULoadStoreSpec, CPUOffloadingManager

if TYPE_CHECKING:
    import torch

    from tracevllm.config import VllmConfig
    from tracevllm.kv_cache_interface import KVCacheConfig
    from tracevllm.kv_offload.cpu.gpu_worker import CpuGpuOffloadingHandlers
    from tracevllm.kv_offload.worker.worker import OffloadingHandler


class CPUOffloadingSpec(OffloadingSpec):
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, kv_cache_config)
        cpu_bytes_to_use = self.extra_config.get("cpu_bytes_to_use")
        if not cpu_bytes_to_use:
            raise ValueError("cpu_bytes_to_use must be specified in kv_connector_extra_config")
        if isinstance(cpu_bytes_to_use, bool) or not isinstance(cpu_bytes_to_use, int | float):
            raise TypeError(
                f"cpu_bytes_to_use must be a number of bytes, got {cpu_bytes_to_use!r}."
            )
        if kv_cache_config.num_blocks > 0:
            total_kv_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
            world_size = vllm_config.parallel_config.world_size
            kv_bytes_per_block = (total_kv_bytes // kv_cache_config.num_blocks) * world_size
        else:
            kv_bytes_per_block = 0
        self.kv_bytes_per_offloaded_block = kv_bytes_per_block * self.block_size_factor
        self.num_blocks = (
            int(cpu_bytes_to_use) // self.kv_bytes_per_offloaded_block
            if self.kv_bytes_per_offloaded_block > 0
            else 0
        )
        self.eviction_policy: str = self.extra_config.get("eviction_policy", "lru")
        directory = self.extra_config.get("cpu_offload_dir")
        if directory is not None and (not isinstance(directory, str) or not directory):
            raise ValueError(
                "kv_connector_extra_config['cpu_offload_dir'] must be a directory, "
                f"got {directory!r}."
            )
        self.cpu_offload_dir: str | None = directory
        self._manager: OffloadingManager | None = None
        self._handlers: CpuGpuOffloadingHandlers | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(
                num_blocks=self.num_blocks, cache_policy=self.eviction_policy
            )
        return self._manager

    def get_handlers(
        self, kv_caches: dict[str, torch.Tensor]
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        if self._handlers is None:
            from tracevllm.kv_offload.cpu.gpu_worker import CpuGpuOffloadingHandlers

            self._handlers = CpuGpuOffloadingHandlers(
                kv_caches, num_cpu_blocks=self.num_blocks, directory=self.cpu_offload_dir
            )
        yield GPULoadStoreSpec, CPULoadStoreSpec, self._handlers.gpu_to_cpu_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self._handlers.cpu_to_gpu_handler
