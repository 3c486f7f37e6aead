"""``CpuGpuOffloadingHandlers``: the copies between the engine's KV cache and the CPU tier.

Mirrors vllm/v1/kv_offload/cpu/gpu_worker.py (vLLM's names: "GPU" is the
engine's paged KV cache, wherever it lives; "CPU" the tier). The tier is
one preallocated int8 region of ``num_cpu_blocks`` slots, each holding one
engine block of every layer (vLLM: ``SharedOffloadRegion``, an mmap); with
a ``directory`` the region is a temporary file there, mapped into memory,
so the tier can live on a disk (a local SSD, a tmpfs) instead of in
anonymous memory. The file is unlinked as soon as it is mapped: the mapping
keeps it until the worker exits, and nothing is left behind if it dies. Each layer's
cache is seen as ``[num_blocks, page_bytes]`` int8 (its block dimension
first, as every tracevllm attention backend lays it out), and a slot's
layer page sits in a ``[num_cpu_blocks, page_bytes]`` view of the region.

A transfer copies whole pages, every layer, by block index
(``dst[dst_ids] = src[src_ids]``). vLLM's handlers queue a copy per CUDA
stream and report it when its event fires; these copy at once, so a
transfer is finished when ``transfer_async`` returns and ``wait`` has
nothing to wait for. Left out: offloaded blocks larger than the engine's
(``block_size_factor``), the cross-layer layout, pinned memory.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence

import torch

from tracevllm.kv_offload.base import BlockIDsLoadStoreSpec
from tracevllm.kv_offload.worker.worker import OffloadingHandler, TransferResult, TransferSpec
from tracevllm.logger import init_logger

logger = init_logger(__name__)


def canonical_kv_caches(kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each distinct KV cache tensor as ``[num_blocks, page_bytes]`` int8, in
    layer order (layers sharing a tensor give it once)."""
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for name, kv_cache in kv_caches.items():
        if kv_cache.data_ptr() in seen:
            continue
        seen.add(kv_cache.data_ptr())
        if not kv_cache.is_contiguous():
            raise ValueError(
                f"KV offloading needs each layer's KV cache contiguous with its blocks "
                f"first; {name}'s is {list(kv_cache.shape)} with strides {kv_cache.stride()}."
            )
        num_blocks = kv_cache.shape[0]
        tensors.append(kv_cache.view(torch.int8).view(num_blocks, -1))
    return tensors


class CpuRegion:
    """The tier's memory: ``num_cpu_blocks`` slots of every layer's page,
    preallocated (zeroed), in memory or mapped from a file."""

    def __init__(
        self, num_cpu_blocks: int, page_sizes: Sequence[int], directory: str | None
    ) -> None:
        self.num_cpu_blocks = num_cpu_blocks
        self.bytes_per_block = sum(page_sizes)
        self.total_size_bytes = num_cpu_blocks * self.bytes_per_block
        self.file_backed = directory is not None
        if directory is None:
            self._base = torch.zeros(self.total_size_bytes, dtype=torch.int8)
        else:
            # A fresh file of exactly the region's size (zeros), mapped shared.
            fd, path = tempfile.mkstemp(prefix="tracevllm-kv-offload-", dir=directory)
            try:
                os.ftruncate(fd, self.total_size_bytes)
                self._base = torch.from_file(
                    path, shared=True, size=self.total_size_bytes, dtype=torch.int8
                )
            finally:
                os.close(fd)
                os.remove(path)
        # One [num_cpu_blocks, page] view per layer tensor, one after another.
        self.tensors: list[torch.Tensor] = []
        offset = 0
        for page in page_sizes:
            size = num_cpu_blocks * page
            self.tensors.append(self._base[offset : offset + size].view(num_cpu_blocks, page))
            offset += size

    def close(self) -> None:
        """Drop the region (its memory goes with the last view of it)."""
        self.tensors = []
        self._base = torch.empty(0, dtype=torch.int8)


class SingleDirectionOffloadingHandler(OffloadingHandler):
    """Copies one way, engine cache to tier (``gpu_to_cpu``) or back."""

    def __init__(
        self,
        gpu_tensors: list[torch.Tensor],
        cpu_tensors: list[torch.Tensor],
        gpu_to_cpu: bool,
        region: CpuRegion | None = None,
    ) -> None:
        assert len(gpu_tensors) == len(cpu_tensors) > 0
        for gpu_tensor, cpu_tensor in zip(gpu_tensors, cpu_tensors, strict=True):
            assert gpu_tensor.dtype == cpu_tensor.dtype == torch.int8
            assert gpu_tensor.shape[1] == cpu_tensor.shape[1], "page sizes differ"
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.gpu_to_cpu = gpu_to_cpu
        self.transfer_type = ("GPU", "CPU") if gpu_to_cpu else ("CPU", "GPU")
        self._finished: list[TransferResult] = []
        # The region to close on shutdown (the gpu_to_cpu handler owns it, as vLLM's).
        self._region = region

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src_spec, dst_spec = spec
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        if len(src_spec.block_ids) != len(dst_spec.block_ids):
            raise ValueError(
                f"transfer {job_id}: {len(src_spec.block_ids)} source blocks, "
                f"{len(dst_spec.block_ids)} destination blocks"
            )
        start = time.perf_counter()
        num_bytes = 0
        if src_spec.block_ids:
            src_ids = torch.tensor(src_spec.block_ids, dtype=torch.int64)
            dst_ids = torch.tensor(dst_spec.block_ids, dtype=torch.int64)
            for src, dst in zip(self.src_tensors, self.dst_tensors, strict=True):
                pages = src[src_ids.to(src.device)]  # [num_blocks, page_bytes]
                dst[dst_ids.to(dst.device)] = pages.to(dst.device)
                num_bytes += pages.numel()
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=num_bytes,
                transfer_time=time.perf_counter() - start,
                transfer_type=self.transfer_type,
            )
        )
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when transfer_async returns

    def shutdown(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None


class CpuGpuOffloadingHandlers:
    """The tier's region and a handler each way."""

    def __init__(
        self, kv_caches: dict[str, torch.Tensor], num_cpu_blocks: int, directory: str | None = None
    ) -> None:
        gpu_tensors = canonical_kv_caches(kv_caches)
        self.region = CpuRegion(num_cpu_blocks, [t.shape[1] for t in gpu_tensors], directory)
        logger.info(
            "KV offloading: a CPU tier of %d blocks (%.1f MiB)%s",
            num_cpu_blocks,
            self.region.total_size_bytes / (1 << 20),
            f", a file in {directory}" if directory else "",
        )
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            gpu_tensors, self.region.tensors, gpu_to_cpu=True, region=self.region
        )
        self.cpu_to_gpu_handler = SingleDirectionOffloadingHandler(
            gpu_tensors, self.region.tensors, gpu_to_cpu=False
        )
