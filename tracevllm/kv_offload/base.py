"""What the offload tier's scheduler side and worker side share: keys, specs, the manager.

Mirrors vllm/v1/kv_offload/base.py. An offloaded block is named by its
``OffloadKey`` (the prefix cache's block hash with the KV cache group index
appended, as vLLM's); the scheduler-side ``OffloadingManager`` answers
``lookup`` (is this block in the tier and readable?), reserves blocks to read
(``prepare_load`` ... ``complete_load``, protected from eviction in between),
marks blocks recently used (``touch``) and finds room for new ones
(``prepare_store``, evicting by its policy, ... ``complete_store``, after
which they can be read); tracevllm adds ``discard``, for blocks a load
failed to read. A ``LoadStoreSpec`` tells a worker where blocks
are: ``GPULoadStoreSpec`` in the engine's paged KV cache (vLLM's name; here
the engine's cache is on whatever device the engine runs on), a tier's own
(``CPULoadStoreSpec``) in the tier. ``OffloadingSpec`` builds the manager
(scheduler side) and the transfer handlers (worker side) of one tier.

Left out: block sizes in the tier larger than the engine's
(``block_size_factor`` is always 1), several KV cache groups, context
parallelism, the canonical cross-layer views (``CanonicalKVCaches``: the
handlers take the engine's per-layer tensors). Torch-free: the scheduler
imports this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

from tracevllm.logger import init_logger

if TYPE_CHECKING:
    import torch

    from tracevllm.config import VllmConfig
    from tracevllm.kv_cache_interface import KVCacheConfig
    from tracevllm.kv_offload.worker.worker import OffloadingHandler

logger = init_logger(__name__)

# A block hash with its KV cache group index, 4 bytes big-endian (vLLM's).
OffloadKey = NewType("OffloadKey", bytes)


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and group index into an ``OffloadKey``."""
    return OffloadKey(block_hash + group_idx.to_bytes(4, "big", signed=False))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    return key[:-4]


def get_offload_group_idx(key: OffloadKey) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


@dataclass
class ReqContext:
    req_id: str
    kv_transfer_params: dict[str, Any] | None = None


class LoadStoreSpec(ABC):
    """Where a worker finds (or puts) blocks of KV data."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium's name: a transfer is routed by (source medium, destination medium)."""


@dataclass
class PrepareStoreOutput:
    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    keys: list[OffloadKey]
    medium: str
    # True if the blocks were removed, False if stored.
    removed: bool


class OffloadingManager(ABC):
    """The tier's bookkeeping, in the scheduler: which blocks it holds, and where.

    ``lookup`` one block; ``prepare_load`` blocks (protected from eviction
    until ``complete_load``); ``touch`` blocks (recency, also for blocks the
    engine's prefix cache already has); ``prepare_store`` blocks (room made
    by eviction; readable after ``complete_store``).
    """

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if the block is offloaded and ready to read, False if not,
        None if a write to it is in flight (ask again later)."""

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Protect these (offloaded, ready) blocks from eviction until
        ``complete_load``; where a worker reads them."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark the blocks recently used."""
        return

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """The blocks prepared for a load are read: they may be evicted again."""
        return

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Room for those of the blocks the tier lacks (evicting others), where
        a worker writes them, and what was evicted; None if there is no room."""

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """The blocks prepared for a store are written (readable from now on),
        or, ``success`` False, dropped."""
        return

    def discard(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Forget these blocks: a load from them failed, so what they hold is
        suspect, and a request that found them again would load (and fail)
        again. A block a load still holds goes once that load completes.
        tracevllm's: vLLM's transfers never fail (its worker asserts so)."""
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The blocks stored and removed since the last call."""
        return ()

    def reset_cache(self) -> None:
        """Forget every block."""
        return

    def shutdown(self) -> None:
        return


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """Blocks by their numbers (vLLM keeps a numpy array; here a list: plain data
    that travels to worker processes)."""

    def __init__(self, block_ids: Sequence[int]) -> None:
        self.block_ids: list[int] = list(block_ids)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the engine's paged KV cache (vLLM's name, whatever the device).

    ``group_sizes[i]``: how many of ``block_ids`` are group i's;
    ``block_indices[i]``: the index, in its request, of group i's first block.
    """

    def __init__(
        self, block_ids: Sequence[int], group_sizes: Sequence[int], block_indices: Sequence[int]
    ) -> None:
        super().__init__(block_ids)
        assert sum(group_sizes) == len(self.block_ids)
        assert len(block_indices) == len(group_sizes)
        self.group_sizes: list[int] = list(group_sizes)
        self.block_indices: list[int] = list(block_indices)

    @staticmethod
    def medium() -> str:
        return "GPU"


class OffloadingSpec(ABC):
    """One kind of tier: builds its manager (scheduler side) and handlers (worker side)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        kv_transfer_config = vllm_config.kv_transfer_config
        assert kv_transfer_config is not None
        self.extra_config = kv_transfer_config.kv_connector_extra_config
        # The engine's block size, per KV cache group.
        self.gpu_block_size: tuple[int, ...] = tuple(
            group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups
        )
        self.hash_block_size: int = vllm_config.cache_config.block_size
        # offloaded block size / engine block size (vLLM's extra_config
        # "block_size"; tracevllm offloads blocks of the engine's size).
        self.block_size_factor: int = 1
        offloaded_block_size = self.extra_config.get("block_size")
        if offloaded_block_size is not None and offloaded_block_size not in self.gpu_block_size:
            raise ValueError(
                "kv_connector_extra_config['block_size'] must be the engine's block size "
                f"{list(set(self.gpu_block_size))} in tracevllm (offloaded blocks larger than "
                f"the engine's are not supported), got {offloaded_block_size!r}."
            )

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The scheduler side's manager (one per spec)."""

    @abstractmethod
    def get_handlers(
        self, kv_caches: dict[str, torch.Tensor]
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """(source spec type, destination spec type, handler) for each direction,
        given the engine's KV cache tensors by layer name."""
