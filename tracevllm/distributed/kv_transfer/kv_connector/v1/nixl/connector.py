"""``NixlConnector``: disaggregated prefill between two live engines, over NIXL.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py. A
prefill engine (``kv_role="kv_producer"`` or ``kv_both``) runs a request sent
with ``kv_transfer_params={"do_remote_decode": True}`` and ``max_tokens=1``,
and keeps its KV blocks; the request's output carries the
``kv_transfer_params`` a decode engine needs. The decode engine, given them,
parks the request in ``WAITING_FOR_REMOTE_KVS`` while its worker READs the
blocks straight out of the prefill worker's KV cache, then computes only the
prompt's last token. No disk, no shared memory: NIXL moves the bytes and
ZeroMQ carries the one handshake per engine pair. The roles split as vLLM's:
``NixlConnectorScheduler`` (nixl/scheduler.py) in the engine core,
``NixlConnectorWorker`` (nixl/worker.py) beside the KV cache.

Why NIXL: it is the transfer library vLLM's own disaggregated prefill uses,
and it installs and runs here without a GPU (pip ``nixl``; its UCX backend
reads host memory to host memory, ``kv_buffer_device="cpu"``). Mooncake's
transfer engine, vLLM's other library-backed connector, fails to load on
this machine (libibverbs is missing), so torch.distributed over gloo was not
needed as a fallback.

Left out: tensor and pipeline parallelism (refused), heterogeneous layouts,
host buffers, heartbeats and leases (a fixed ``TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT``,
which the reader is told and keeps clear of), connector stats. The other
departures (an expiry, a token and a MAC in ``kv_transfer_params``, a bound on a
READ, remote agents keyed by address, an optional list of allowed producers,
the side channel served by producers only) are listed in nixl/worker.py and
nixl/scheduler.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracevllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    require_one_worker,
)
from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)
from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
    NixlConnectorScheduler,
)

if TYPE_CHECKING:
    import torch

    from tracevllm.attention.backends.abstract import AttentionMetadata
    from tracevllm.config import VllmConfig
    from tracevllm.core.kv_cache_manager import KVCacheBlocks
    from tracevllm.core.sched.output import SchedulerOutput
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (
        NixlConnectorWorker,
    )
    from tracevllm.forward_context import ForwardContext
    from tracevllm.kv_cache_interface import KVCacheConfig
    from tracevllm.outputs import KVConnectorOutput
    from tracevllm.request import Request


class NixlConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        require_one_worker(
            vllm_config,
            "tracevllm's NixlConnector supports one worker per engine "
            "(tensor_parallel_size=1, pipeline_parallel_size=1).",
        )
        if self._kv_transfer_config.kv_buffer_device != "cpu":
            raise ValueError(
                "tracevllm's NixlConnector reads host memory: kv_buffer_device must be 'cpu', "
                f"got {self._kv_transfer_config.kv_buffer_device!r}."
            )
        engine_id = self._kv_transfer_config.engine_id
        assert engine_id is not None
        self.engine_id = engine_id
        self.connector_scheduler: NixlConnectorScheduler | None = None
        self.connector_worker: NixlConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlConnectorScheduler(
                vllm_config, engine_id, kv_cache_config
            )
        else:
            # Imported here: the scheduler's side needs neither NIXL nor torch.
            from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (
                NixlConnectorWorker,
            )

            self.connector_worker = NixlConnectorWorker(vllm_config, engine_id)

    # --------------------------------------------------------- scheduler side
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
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, NixlConnectorMetadata)
        self.connector_worker.start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """NixlConnector does not do layerwise loading: a request runs only
        once its blocks are read."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """NixlConnector does not save explicitly: the reader pulls the blocks."""

    def wait_for_save(self) -> None:
        """Nothing to wait for (see save_kv_layer)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.connector_worker is not None
        done_sending, done_recving = self.connector_worker.get_finished()
        return done_sending or None, done_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
