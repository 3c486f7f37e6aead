"""``OffloadingConnector``: KV blocks kept in a second tier, loaded back on a prefix hit.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py.
The connector is a thin shell over its two roles (offloading/scheduler.py,
offloading/worker.py) and the tier an ``OffloadingSpec`` builds
(tracevllm/kv_offload/, vLLM's vllm/v1/kv_offload/): by default
``CPUOffloadingSpec``, a host-memory region of ``cpu_bytes_to_use`` bytes
with its own LRU. ``--kv-offloading-size GiB`` (``kv_offloading_backend``
``native``) configures it as vLLM does: ``kv_connector="OffloadingConnector"``,
``kv_role="kv_both"``, ``cpu_bytes_to_use`` in ``kv_connector_extra_config``.

Every block an engine fills is stored in the tier too (write-through), so
when the engine's prefix cache evicts a prompt's blocks, a later request
with that prefix still finds them: its scheduler-side lookup continues
past the local hit into the tier, the blocks are copied back into fresh
engine blocks (``start_load_kv``) in a step of their own while the request
waits in ``WAITING_FOR_REMOTE_KVS``, as vLLM's (or, with
``kv_connector_extra_config["async_load"]: false``, before the forward that
computes the rest of the prompt). Each request's load and store in a step is
one span (``OffloadingConnector.wait_for_layer_load`` / ``.save_kv_layer``).

tracevllm departs from vLLM in the roles' docstrings (synchronous loads as
an option, copies done within their step) and refuses what it does not run: tensor or
pipeline parallelism, a model with a sliding window, and prefix caching off
(the tier is keyed by the prefix cache's block hashes, which tracevllm
computes only with prefix caching on). Left out: vLLM's cross-layer KV
layout, KV cache events, Prometheus metrics, ``handle_preemptions``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from tracevllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    require_one_worker,
)
from tracevllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from tracevllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from tracevllm.kv_offload.factory import OffloadingSpecFactory

if TYPE_CHECKING:
    import torch

    from tracevllm.attention.backends.abstract import AttentionMetadata
    from tracevllm.config import VllmConfig
    from tracevllm.core.kv_cache_manager import KVCacheBlocks
    from tracevllm.core.sched.output import SchedulerOutput
    from tracevllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )
    from tracevllm.forward_context import ForwardContext
    from tracevllm.kv_cache_interface import KVCacheConfig
    from tracevllm.outputs import KVConnectorOutput
    from tracevllm.request import Request


def _check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    from tracevllm.kv_cache_interface import FullAttentionSpec

    require_one_worker(
        vllm_config,
        "OffloadingConnector runs on one worker in tracevllm (tensor_parallel_size and "
        "pipeline_parallel_size 1).",
    )
    if not vllm_config.cache_config.enable_prefix_caching:
        raise ValueError(
            "OffloadingConnector (--kv-offloading-size) needs prefix caching on in tracevllm: "
            "the offloaded blocks are keyed by the prefix cache's block hashes."
        )
    for group in kv_cache_config.kv_cache_groups:
        if type(group.kv_cache_spec) is not FullAttentionSpec:
            raise ValueError(
                "OffloadingConnector offloads full-attention layers only in tracevllm; this "
                f"model's KV cache is {type(group.kv_cache_spec).__name__}."
            )


class OffloadingConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _check_supported(vllm_config, kv_cache_config)
        spec = OffloadingSpecFactory.create_spec(vllm_config, kv_cache_config)
        self.connector_scheduler: OffloadingConnectorScheduler | None = None
        self.connector_worker: OffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = OffloadingConnectorScheduler(spec)
        elif role == KVConnectorRole.WORKER:
            from tracevllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
                OffloadingConnectorWorker,
            )

            self.connector_worker = OffloadingConnectorWorker(spec)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, OffloadingConnectorMetadata)
        self.connector_worker.start_kv_transfers(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer was loaded in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole blocks are stored after the forward (get_finished)

    def wait_for_save(self) -> None:
        # Stores run in get_finished, which runs even on a step without a
        # forward (where wait_for_save is skipped), as vLLM's defers them.
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.connector_worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, OffloadingConnectorMetadata)
        self.connector_worker.store_kv(metadata)
        return self.connector_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The tier's counters: the scheduler side's blocks and external
        prefix-cache tokens, or the worker side's transfers by direction."""
        if self.connector_scheduler is not None:
            manager_stats = getattr(self.connector_scheduler.manager, "stats", None)
            stats: dict[str, Any] = {
                "connector_prefix_cache_stats": asdict(self.connector_scheduler.stats)
            }
            if manager_stats is not None:
                stats["offload"] = asdict(manager_stats)
            return stats
        if self.connector_worker is not None:
            return {k: dict(v) for k, v in self.connector_worker.transfer_stats.items()}
        return None

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(
            connector_output.finished_recving, connector_output.invalid_block_ids
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request)

    def reset_cache(self) -> bool | None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.reset_cache()
        return True
