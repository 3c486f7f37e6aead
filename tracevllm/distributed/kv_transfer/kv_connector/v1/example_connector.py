"""``ExampleConnector``: vLLM's reference KV connector, through files on a shared disk.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py.
A producer (``kv_role="kv_producer"``) saves, layer by layer as the forward
writes it, the KV of each new prompt's full blocks to
``<shared_storage_path>/<hash of those tokens>/<layer name>.safetensors``; a
consumer (``kv_consumer``) that gets the same prompt finds the folder in
``get_num_new_matched_tokens``, the scheduler allocates blocks for those
tokens and schedules only the rest of the prompt, and the worker copies each
layer's KV into those blocks just before the layer's attention reads them
(``wait_for_layer_load``). Loads and saves are synchronous: a request is
never in ``WAITING_FOR_REMOTE_KVS`` with this connector.

Where tracevllm departs from vLLM's, and why:

- The tokens kept are the full blocks before the prompt's last token,
  ``(len(prompt) - 1) // block_size * block_size``, on both sides (the
  prefix cache's rule: the last token is always computed, for its logits).
  vLLM's saves that many but looks up one block fewer when
  ``len(prompt) - 1`` is a multiple of the block size, and then misses.
- Roles are honoured: a producer only saves, a consumer only loads
  (``kv_both`` does both). vLLM's saves every prompt it did not find.
- Each layer is loaded in ``wait_for_layer_load``, before that layer's
  attention (vLLM's loads every layer in ``start_load_kv``), and only the
  blocks past the local prefix-cache hit (vLLM's writes over the hit too).
- A prompt longer than one step's budget (chunked prefill) is saved in the
  step that completes its kept blocks (vLLM's saves in its first step,
  before the later chunks are computed).
- A folder counts only once its ``complete`` marker is written, after every
  layer's file (``wait_for_save``), so a half-written save is never a hit.
- A file that is missing, unreadable, of the wrong dtype or shape is a load
  error: its blocks go back in ``get_block_ids_with_load_errors`` and the
  scheduler recomputes them or fails the request (``kv_load_failure_policy``).
  vLLM's raises, and the engine dies.
- Each request's save and load is one span (layers, bytes, blocks,
  milliseconds) in the request's trace; a producer's finished request returns
  its trace context in ``kv_transfer_params``, so a consumer given them
  continues the same trace.

Left out: multimodal hashes, MLA layouts, tensor and pipeline parallelism
(each rank would write the same files: refused).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracevllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    require_one_worker,
)
from tracevllm.logger import init_logger
from tracevllm.tracing import kv_transfer as kv_transfer_tracing

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from tracevllm.attention.backends.abstract import AttentionMetadata
    from tracevllm.config import VllmConfig
    from tracevllm.core.kv_cache_manager import KVCacheBlocks
    from tracevllm.core.sched.output import SchedulerOutput
    from tracevllm.forward_context import ForwardContext
    from tracevllm.kv_cache_interface import KVCacheConfig
    from tracevllm.request import Request

logger = init_logger(__name__)

# Written last into a folder: its files are all there.
COMPLETE_MARKER = "complete"


@dataclass(slots=True)
class ReqMeta:
    """One request's load or save this step: tokens [start, end) of the
    stored prefix, in these blocks (the request's first blocks)."""

    req_id: str
    # Hash of the stored prefix's token ids: the folder's name.
    key: str
    block_ids: list[int]
    start: int
    end: int
    is_store: bool
    trace_headers: Mapping[str, str] | None = None
    # A load's: the producer's trace context, from the request's kv_transfer_params.
    remote_trace_headers: Mapping[str, str] | None = None


@dataclass
class ExampleConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)


@dataclass(slots=True)
class _PendingSave:
    """A producer's prompt whose kept blocks are not all computed yet."""

    key: str
    block_ids: list[int]
    num_tokens: int
    trace_headers: Mapping[str, str] | None


def num_tokens_to_transfer(num_prompt_tokens: int, block_size: int) -> int:
    """The prompt's full blocks before its last token (see the module docstring)."""
    return max(num_prompt_tokens - 1, 0) // block_size * block_size


def prefix_key(token_ids: list[int]) -> str:
    """The folder name of a prefix: sha256 of its ids as little-endian int64s."""
    data = b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids)
    return hashlib.sha256(data).hexdigest()


class ExampleConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        require_one_worker(
            vllm_config,
            "ExampleConnector runs on one worker (tensor_parallel_size and "
            "pipeline_parallel_size 1): each rank would write the same files.",
        )
        self._block_size = vllm_config.cache_config.block_size
        storage_path = self._kv_transfer_config.get_from_extra_config("shared_storage_path", "/tmp")
        if not isinstance(storage_path, str) or not storage_path:
            raise ValueError(
                "kv_connector_extra_config['shared_storage_path'] must be a non-empty "
                f"string (a directory), got {storage_path!r}."
            )
        self._storage_path = storage_path
        self._is_producer = self._kv_transfer_config.is_kv_producer
        self._is_consumer = self._kv_transfer_config.is_kv_consumer
        logger.info("ExampleConnector (%s): shared storage path is %s", role.name, storage_path)

        # Scheduler side, until the next meta: req_id -> (request, tokens to
        # load); and the requests admitted without a load.
        self._requests_need_load: dict[str, tuple[Request, int]] = {}
        self._requests_allocated: dict[str, Request] = {}
        self._unfinished_saves: dict[str, _PendingSave] = {}

        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._loads: list[tuple[ReqMeta, torch.Tensor]] = []
        self._failed_loads: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        # (req_id, "load" | "save") -> what this step moved, for its span.
        self._transfers: dict[tuple[str, str], kv_transfer_tracing.KVTransferRecord] = {}

    # ------------------------------------------------------------ scheduler side
    # --8<-- [start:get_num_new_matched_tokens]
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The stored prefix's tokens past the local prefix-cache hit, if the
        prompt's prefix is stored; loaded synchronously (False)."""
        if not self._is_consumer:
            return 0, False
        num_tokens = num_tokens_to_transfer(request.num_prompt_tokens, self._block_size)
        if num_tokens <= num_computed_tokens:
            return 0, False
        if not self._found_match(prefix_key(request.prompt_token_ids[:num_tokens])):
            return 0, False
        return num_tokens - num_computed_tokens, False

    # --8<-- [end:get_num_new_matched_tokens]

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remember to load the request in this step's forward (a producer:
        the request, whose trace its save joins)."""
        if num_external_tokens > 0:
            self._requests_need_load[request.request_id] = (request, num_external_tokens)
        elif self._is_producer:
            self._requests_allocated[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ExampleConnectorMetadata()
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            block_ids = new_req.block_ids[0]
            if new_req.req_id in self._requests_need_load:
                request, num_external = self._requests_need_load.pop(new_req.req_id)
                meta.requests.append(
                    self._load_meta(request, block_ids, new_req.num_computed_tokens, num_external)
                )
            elif self._is_producer:
                num_tokens = num_tokens_to_transfer(len(new_req.prompt_token_ids), self._block_size)
                key = prefix_key(new_req.prompt_token_ids[:num_tokens])
                if num_tokens == 0 or self._found_match(key):
                    continue
                admitted = self._requests_allocated.get(new_req.req_id)
                trace_headers = admitted.trace_headers if admitted is not None else None
                pending = _PendingSave(key, list(block_ids), num_tokens, trace_headers)
                num_after_step = new_req.num_computed_tokens + num_scheduled[new_req.req_id]
                self._maybe_save(meta, new_req.req_id, pending, num_after_step)

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_block_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed and req_id in self._requests_need_load:
                # Preempted, then found again: a resumed request's blocks are all new.
                assert new_block_ids is not None
                request, num_external = self._requests_need_load.pop(req_id)
                meta.requests.append(
                    self._load_meta(
                        request, new_block_ids[0], cached.num_computed_tokens[i], num_external
                    )
                )
            elif req_id in self._unfinished_saves:
                pending = self._unfinished_saves.pop(req_id)
                if resumed:
                    assert new_block_ids is not None
                    pending.block_ids = list(new_block_ids[0])
                elif new_block_ids is not None:
                    pending.block_ids.extend(new_block_ids[0])
                num_after_step = cached.num_computed_tokens[i] + num_scheduled[req_id]
                self._maybe_save(meta, req_id, pending, num_after_step)
        # Aborted between allocation and this step: nothing to load.
        self._requests_need_load.clear()
        self._requests_allocated.clear()
        return meta

    def _load_meta(
        self, request: Request, block_ids: list[int], num_computed_tokens: int, num_external: int
    ) -> ReqMeta:
        """Load tokens [num_computed - num_external, num_computed): the ones
        past the local hit (num_computed counts both)."""
        num_tokens = num_tokens_to_transfer(request.num_prompt_tokens, self._block_size)
        assert num_computed_tokens <= num_tokens, (num_computed_tokens, num_tokens)
        return ReqMeta(
            req_id=request.request_id,
            key=prefix_key(request.prompt_token_ids[:num_tokens]),
            block_ids=list(block_ids[: num_computed_tokens // self._block_size]),
            start=num_computed_tokens - num_external,
            end=num_computed_tokens,
            is_store=False,
            trace_headers=request.trace_headers,
            remote_trace_headers=kv_transfer_tracing.remote_trace_headers(
                request.kv_transfer_params
            ),
        )

    def _maybe_save(
        self, meta: ExampleConnectorMetadata, req_id: str, pending: _PendingSave, num_after: int
    ) -> None:
        """Save in the step that computes the last kept token; until then, wait."""
        if num_after < pending.num_tokens:
            self._unfinished_saves[req_id] = pending
            return
        num_blocks = pending.num_tokens // self._block_size
        meta.requests.append(
            ReqMeta(
                req_id=req_id,
                key=pending.key,
                block_ids=pending.block_ids[:num_blocks],
                start=0,
                end=pending.num_tokens,
                is_store=True,
                trace_headers=pending.trace_headers,
            )
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are free at once (saves are synchronous). A producer's
        request returns ``kv_transfer_params``: that its prefill was done
        remotely, for the consumer, and its trace context."""
        self._unfinished_saves.pop(request.request_id, None)
        self._requests_need_load.pop(request.request_id, None)
        if not self._is_producer:
            return False, None
        params: dict[str, Any] = {"do_remote_prefill": True}
        return False, kv_transfer_tracing.add_trace_context(params, request.trace_headers)

    def _found_match(self, key: str) -> bool:
        return os.path.exists(os.path.join(self._storage_path, key, COMPLETE_MARKER))

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Note this step's loads; each layer's is read in ``wait_for_layer_load``."""
        import torch

        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        self._loads = []
        for req in metadata.requests:
            if not req.is_store:
                self._loads.append((req, self._slot_mapping(req, torch)))

    # --8<-- [start:wait_for_layer_load]
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Copy this layer's stored KV into the request's blocks, before its attention."""
        from safetensors.torch import load_file

        kv_cache = self._kv_caches[layer_name]  # [num_blocks, 2, block_size, H_kv, D]
        for req, slots in self._loads:
            if req.req_id in self._failed_loads:
                continue
            record = self._record(req, "load")
            start_ns = time.time_ns()
            path = self._layer_path(req.key, layer_name)
            try:
                stored = load_file(path)["kv_cache"]  # [num_stored_tokens, 2, H_kv, D]
                # One token's K and V in this cache: [2, H_kv, D].
                token_shape = (kv_cache.shape[1], *kv_cache.shape[3:])
                if stored.dtype != kv_cache.dtype or tuple(stored.shape[1:]) != token_shape:
                    raise ValueError(
                        f"holds {stored.dtype} {list(stored.shape)}, this cache needs "
                        f"{kv_cache.dtype} [{req.end}, {', '.join(map(str, token_shape))}]"
                    )
                if stored.shape[0] < req.end:
                    raise ValueError(f"holds {stored.shape[0]} tokens, {req.end} needed")
                rows = stored[req.start : req.end]  # [num_tokens, 2, H_kv, D]
                kv_cache[slots // self._block_size, :, slots % self._block_size] = rows
            except Exception as e:  # missing, truncated, corrupt or foreign file
                logger.warning(
                    "ExampleConnector: cannot load %s for request %s: %s", path, req.req_id, e
                )
                self._failed_loads.add(req.req_id)
                first_block = req.start // self._block_size
                self._invalid_block_ids.update(req.block_ids[first_block:])
                record.error = f"{type(e).__name__}: {e}"
                continue
            record.add(rows.numel() * rows.element_size(), start_ns, time.time_ns())

    # --8<-- [end:wait_for_layer_load]

    # --8<-- [start:save_kv_layer]
    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,  # [num_blocks, 2, block_size, H_kv, D]
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Write the kept blocks' KV of this layer, after the layer wrote its cache."""
        import torch
        from safetensors.torch import save_file

        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        for req in metadata.requests:
            if not req.is_store:
                continue
            record = self._record(req, "save")
            start_ns = time.time_ns()
            slots = self._slot_mapping(req, torch)
            rows = kv_layer[slots // self._block_size, :, slots % self._block_size]
            folder = os.path.join(self._storage_path, req.key)
            os.makedirs(folder, exist_ok=True)
            path = self._layer_path(req.key, layer_name)
            # Whole files only: a reader never sees one half-written.
            save_file({"kv_cache": rows.contiguous()}, path + ".tmp")  # [tokens, 2, H_kv, D]
            os.replace(path + ".tmp", path)
            record.add(rows.numel() * rows.element_size(), start_ns, time.time_ns())

    # --8<-- [end:save_kv_layer]

    def wait_for_save(self) -> None:
        """Every layer is written: mark the folders complete (they now count as hits)."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        for req in metadata.requests:
            if req.is_store:
                marker = os.path.join(self._storage_path, req.key, COMPLETE_MARKER)
                with open(marker, "w") as f:
                    f.write(f"{len(self._kv_caches)} layers, {req.end} tokens\n")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is asynchronous; the step's transfers end their spans here."""
        for record in self._transfers.values():
            kv_transfer_tracing.record_kv_transfer(record)
        self._transfers.clear()
        self._loads = []
        self._failed_loads.clear()
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    # ------------------------------------------------------------------ helpers
    def _slot_mapping(self, req: ReqMeta, torch: Any) -> torch.Tensor:
        """Slots of tokens [start, end) in the request's blocks."""
        positions = torch.arange(req.start, req.end)  # [num_tokens]
        block_ids = torch.tensor(req.block_ids, dtype=torch.int64)
        return block_ids[positions // self._block_size] * self._block_size + (
            positions % self._block_size
        )

    def _layer_path(self, key: str, layer_name: str) -> str:
        return os.path.join(self._storage_path, key, f"{layer_name}.safetensors")

    def _record(self, req: ReqMeta, direction: str) -> kv_transfer_tracing.KVTransferRecord:
        record = self._transfers.get((req.req_id, direction))
        if record is None:
            record = kv_transfer_tracing.KVTransferRecord(
                connector=type(self).__name__,
                direction=direction,
                request_id=req.req_id,
                trace_headers=req.trace_headers,
                num_blocks=len(req.block_ids[req.start // self._block_size :]),
                num_tokens=req.end - req.start,
                remote_trace_headers=req.remote_trace_headers,
            )
            self._transfers[(req.req_id, direction)] = record
        return record
