"""``KVConnectorBase_V1``: the interface every KV connector implements, in two roles.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/base.py. A connector
class is instantiated twice per engine: once in the scheduler
(``KVConnectorRole.SCHEDULER``), once in each worker (``WORKER``). They talk
one way through ``KVConnectorMetadata``, built by the scheduler side each
step (``build_connector_meta``) and bound to the worker side before the
forward (``bind_connector_metadata``); the other way through the step's
``KVConnectorOutput`` (``get_finished``, ``get_block_ids_with_load_errors``).

Scheduler side, in the order the scheduler calls it:

- ``get_num_new_matched_tokens(request, num_computed_tokens)``: how many of
  the prompt's tokens past the local prefix-cache hit the connector can
  supply, and whether it loads them asynchronously (then the request waits
  in ``WAITING_FOR_REMOTE_KVS`` until a step's ``finished_recving`` names it);
- ``update_state_after_alloc(request, blocks, num_external_tokens)``: the
  blocks those tokens go into;
- ``build_connector_meta(scheduler_output)``: what the workers load and save
  this step;
- ``request_finished(request, block_ids)``: whether the blocks are still
  needed (an asynchronous send: freed when ``finished_sending`` names the
  request), and the ``kv_transfer_params`` to return with the request.

Worker side, within one forward: ``start_load_kv`` before it,
``wait_for_layer_load`` before each layer's attention, ``save_kv_layer``
after each layer's cache write, ``wait_for_save`` after it, ``get_finished``
at the end. Torch is imported only for type checking: the scheduler's side of
a connector must not need it.

Left out: hybrid-allocator support (``SupportsHMA``; tracevllm refuses a
connector on a model with several KV cache groups), cross-layer KV blocks,
host transfer buffers, handshake metadata, connector stats and Prometheus
metrics, KV cache events, worker-to-scheduler metadata.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from tracevllm.logger import init_logger

if TYPE_CHECKING:
    import torch

    from tracevllm.attention.backends.abstract import AttentionMetadata
    from tracevllm.config import VllmConfig
    from tracevllm.core.kv_cache_manager import KVCacheBlocks
    from tracevllm.core.sched.output import SchedulerOutput
    from tracevllm.distributed.kv_transfer.kv_transfer_config import KVTransferConfig
    from tracevllm.forward_context import ForwardContext
    from tracevllm.kv_cache_interface import KVCacheConfig
    from tracevllm.outputs import KVConnectorOutput
    from tracevllm.request import Request

logger = init_logger(__name__)


def require_one_worker(vllm_config: VllmConfig, message: str) -> None:
    """Refuse tensor or pipeline parallelism for a connector that moves one
    worker's KV (tracevllm's connectors all do); ``message`` says which and why."""
    parallel_config = vllm_config.parallel_config
    if parallel_config.tensor_parallel_size > 1 or parallel_config.pipeline_parallel_size > 1:
        raise ValueError(message)


class KVConnectorRole(enum.Enum):
    # The connector in the scheduler (the engine core process).
    SCHEDULER = 0
    # The connector in each worker, beside the KV cache tensors.
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024 (vLLM's: a marker base class)
    """What the scheduler-side connector tells the worker-side one each step.

    It travels inside ``SchedulerOutput.kv_connector_metadata``, to worker
    processes too: keep it plain data.
    """


class KVConnectorBase_V1(ABC):  # noqa: N801 (vLLM's name)
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config: KVTransferConfig = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ------------------------------------------------------------ worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Set this step's metadata (the model runner, before the forward)."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Drop it again (the model runner, after the forward)."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "only within a forward"
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The KV cache tensors, by layer name, once they are allocated
        (a transfer library would register their memory here)."""
        return

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start loading this step's KV into the paged cache (before the forward)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV is in the paged cache (before its attention)."""

    @abstractmethod
    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Start saving ``layer_name``'s KV from the paged cache (after its cache write)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until every save started this step is done (after the forward),
        so the blocks can be overwritten."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose asynchronous send finished, requests whose
        asynchronous load finished), given the requests that finished
        generating. A synchronous connector has none."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that failed to load, reported in the step that found the
        failure (synchronous loads) or by the step whose ``finished_recving``
        names the request (asynchronous ones)."""
        return set()

    def shutdown(self) -> None:
        """Finish or cancel whatever is in flight (the engine is going away)."""
        return

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The connector's counters, for ``SchedulerStats.kv_connector_stats``
        (vLLM's ``KVConnectorStats.data``); None if it keeps none."""
        return None

    # --------------------------------------------------------- scheduler side
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(tokens the connector can supply past ``num_computed_tokens``, whether
        it loads them asynchronously). None: not known yet, ask again next step.
        Side-effect free: it may be asked again for the same request."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """The request's blocks after ``allocate_slots``; the first
        ``num_external_tokens`` past its local hit are the connector's to fill."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata for the workers; resets the per-step state.
        Must not change ``scheduler_output``."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """What the worker side reported this step."""
        return

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes, before its blocks are freed.

        Returns (True if the connector still reads the blocks, which are then
        freed when ``get_finished`` reports the request, and the
        ``kv_transfer_params`` to return with the request's last output).
        """
        return False, None
