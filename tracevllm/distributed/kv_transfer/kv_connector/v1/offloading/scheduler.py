"""``OffloadingConnectorScheduler``: the offload tier's side in the scheduler.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py.
Every request's full blocks are named by ``OffloadKey``\\ s (its block
hashes, the prefix cache's). Each step:

- ``get_num_new_matched_tokens``: past the engine's own prefix-cache hit,
  the longest run of the request's next blocks the tier holds
  (``lookup``), as tokens to load; the request's blocks are ``touch``\\ ed.
  As vLLM's, the load is asynchronous (``(n, True)``), and a request whose
  hit includes blocks another request is loading right now waits a step
  (None), then finds them in the engine's prefix cache;
- ``update_state_after_alloc``: those tokens' blocks (allocated by the
  scheduler right after the local hit) become a load job, the tier's slots
  reserved (``prepare_load``); an asynchronous load's request waits in
  ``WAITING_FOR_REMOTE_KVS``, its blocks not yet in the prefix cache;
- ``build_connector_meta``: the step's loads, and a store job for every
  block a scheduled request fills up this step that the tier lacks
  (``prepare_store``, which evicts by LRU): write-through, so that a block
  is in the tier before the engine's prefix cache evicts it;
- ``update_connector_output``: an asynchronous load the workers report
  done (``finished_recving``) releases its slots (``complete_load``); the
  scheduler then runs the request from its first token past the load. The
  tier's blocks behind a load that failed are discarded (tracevllm's:
  vLLM's loads never fail), so no request loads them again.

Where tracevllm departs from vLLM's, and why:

- ``kv_connector_extra_config["async_load"]: false`` loads synchronously
  instead (``(n, False)``, tracevllm's): the request is admitted with its
  load and its first chunk together, the worker copies the blocks in before
  that step's forward, and the hit stops one token short (the full blocks
  before the last token, as the prefix cache's); no step is spent waiting.
  An asynchronous load admits a request with only its loaded blocks; with a
  pool so small that loaded requests hold every free block while nothing
  runs, vLLM's scheduler steps without end, tracevllm's makes one of them
  give its blocks back (``Scheduler._free_loaded_waiting_request``).
- Every job is done within the step whose metadata carries it (loads
  before the forward, stores after it, one worker, in order), so stores
  are completed (``complete_store``) as the metadata is built (a
  synchronous load's too): a later step's transfer can only run after them.
  vLLM's workers report finished jobs back (``OffloadingWorkerMetadata``),
  and it fences reused blocks with ``jobs_to_flush``.
- One KV cache group of full attention (vLLM's sliding-window and Mamba
  groups, offloaded blocks larger than the engine's, are left out).

The tier's counters (hits, stores, evictions) and vLLM's external prefix
cache queries and hits are in the connector's ``get_kv_connector_stats``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracevllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    ReqId,
    TransferJob,
)
from tracevllm.kv_offload.base import (
    GPULoadStoreSpec,
    OffloadingManager,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from tracevllm.labs import lab_hook
from tracevllm.logger import init_logger

if TYPE_CHECKING:
    from tracevllm.core.kv_cache_manager import KVCacheBlocks
    from tracevllm.core.sched.output import SchedulerOutput
    from tracevllm.request import Request

logger = init_logger(__name__)


@dataclass(slots=True)
class TransferJobStatus:
    req_id: ReqId
    keys: list[OffloadKey]
    is_store: bool


@dataclass(slots=True)
class RequestOffloadState:
    req: Request
    req_context: ReqContext
    offload_keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Index of the next block to offload.
    next_stored_block_idx: int = 0
    # Tokens the engine's prefix cache had when the request was looked up.
    num_locally_computed_tokens: int = 0

    def update_offload_keys(self) -> None:
        """A key for each block hash the request gained (its blocks filled up)."""
        for block_hash in self.req.block_hashes[len(self.offload_keys) :]:
            self.offload_keys.append(make_offload_key(block_hash, 0))


@dataclass
class OffloadingSchedulerStats:
    """vLLM's external prefix cache counters (tokens), since the engine started.

    ``queries``: prompt tokens past the local prefix-cache hit when a
    request was admitted; ``hits``: of those, the tier's.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0


def get_async_load(extra_config: dict[str, Any]) -> bool:
    """``kv_connector_extra_config["async_load"]``: vLLM's asynchronous loads
    (default True; False: synchronous, see the module docstring)."""
    value = extra_config.get("async_load", True)
    if not isinstance(value, bool):
        raise TypeError(f"kv_connector_extra_config['async_load'] must be a bool, got {value!r}.")
    return value


def yield_req_data(
    scheduler_output: SchedulerOutput,
) -> Iterator[tuple[str, tuple[list[int], ...] | None, bool]]:
    """(request id, blocks new this step, whether it resumed after a
    preemption: its blocks then are all new), for every scheduled request
    (vllm/distributed/kv_transfer/kv_connector/utils.py)."""
    for new_req in scheduler_output.scheduled_new_reqs:
        yield new_req.req_id, new_req.block_ids, False
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        yield req_id, cached.new_block_ids[i], req_id in cached.resumed_req_ids


class OffloadingConnectorScheduler:
    def __init__(self, spec: OffloadingSpec) -> None:
        assert len(spec.gpu_block_size) == 1, "one KV cache group"
        self.load_async = get_async_load(spec.extra_config)
        self.block_size = spec.gpu_block_size[0]
        self.manager: OffloadingManager = spec.get_manager()
        self._req_status: dict[ReqId, RequestOffloadState] = {}
        self._current_batch_load_jobs: dict[int, TransferJob] = {}
        self._job_counter = 0
        self._jobs: dict[int, TransferJobStatus] = {}
        # Loads in flight: the request's job, and every key being loaded.
        self._load_job_ids: dict[ReqId, int] = {}
        self._blocks_being_loaded: set[OffloadKey] = set()
        # The key last loaded into each engine block, to name the tier's
        # blocks behind a failed load (the workers report engine block ids).
        self._loaded_keys_by_block: dict[int, OffloadKey] = {}
        self.stats = OffloadingSchedulerStats()

    def _generate_job_id(self) -> int:
        job_id = self._job_counter
        self._job_counter += 1
        return job_id

    # ------------------------------------------------------------------ lookup
    # --8<-- [start:maximal_prefix_lookup]
    def _maximal_prefix_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> int | None:
        """Consecutive offloaded blocks from the start; None if a lookup was deferred."""
        hit_count = 0
        defer_lookup = False
        for key in keys:
            result = self.manager.lookup(key, req_context)
            if result is None:
                # In flight: go on, so the manager sees every block up to a miss.
                defer_lookup = True
                result = True
            if not result:
                break
            hit_count += 1
        return None if defer_lookup else hit_count

    # --8<-- [end:maximal_prefix_lookup]

    # --8<-- [start:offloading_lookup]
    @lab_hook("_lookup")  # lab 15: chapters/15-offload-lookup
    def _lookup(self, req_status: RequestOffloadState) -> int | None:
        """Tokens past the local hit the tier can supply (0: none worth a load)."""
        block_size = self.block_size
        num_computed_tokens = req_status.num_locally_computed_tokens
        if self.load_async:
            # Every full block, the last token's too: after a whole prompt is
            # loaded the scheduler computes its last token again.
            max_hit_tokens = req_status.req.num_tokens
        else:
            # The full blocks before the last token: one is left to compute.
            max_hit_tokens = (req_status.req.num_tokens - 1) // block_size * block_size
        max_hit_tokens = min(max_hit_tokens, len(req_status.offload_keys) * block_size)
        if max_hit_tokens - num_computed_tokens < block_size:
            return 0  # less than a block to load: better compute it
        start_block_idx = num_computed_tokens // block_size
        keys = req_status.offload_keys[start_block_idx : max_hit_tokens // block_size]
        num_hit_blocks = self._maximal_prefix_lookup(keys, req_status.req_context)
        if num_hit_blocks is None:
            logger.debug("Request %s: blocks in flight, ask again", req_status.req_context.req_id)
            return None
        if not num_hit_blocks:
            return 0
        # Another request is loading some of them: wait for its load, then
        # find them in the prefix cache.
        if not self._blocks_being_loaded.isdisjoint(keys[:num_hit_blocks]):
            logger.debug("Request %s: its blocks are being loaded", req_status.req_context.req_id)
            return None
        return (start_block_idx + num_hit_blocks) * block_size - num_computed_tokens

    # --8<-- [end:offloading_lookup]

    # --8<-- [start:offloading_get_num_new_matched_tokens]
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The tier's tokens past the local hit, and whether they load asynchronously."""
        req_status = self._req_status.get(request.request_id)
        if req_status is None:
            req_status = RequestOffloadState(
                req=request,
                req_context=ReqContext(request.request_id, request.kv_transfer_params),
            )
            self._req_status[request.request_id] = req_status
        else:
            req_status.block_ids.clear()
        req_status.update_offload_keys()
        req_status.num_locally_computed_tokens = num_computed_tokens
        num_hit_tokens = self._lookup(req_status)
        # Most recently used: the whole request, hit or not.
        self.manager.touch(req_status.offload_keys, req_status.req_context)
        return num_hit_tokens, self.load_async and bool(num_hit_tokens)

    # --8<-- [end:offloading_get_num_new_matched_tokens]

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """A load job for the tier's tokens, into the blocks after the local hit."""
        req_status = self._req_status.get(request.request_id)
        if req_status is None:
            return
        num_local = req_status.num_locally_computed_tokens
        self.stats.requests += 1
        self.stats.queries += request.num_tokens - num_local
        self.stats.hits += num_external_tokens
        if num_external_tokens == 0:
            return
        block_size = self.block_size
        start_block_idx = num_local // block_size
        end_block_idx = (num_local + num_external_tokens) // block_size
        keys_to_load = req_status.offload_keys[start_block_idx:end_block_idx]
        dst_block_ids = [b.block_id for b in blocks.blocks[0][start_block_idx:end_block_idx]]
        assert len(dst_block_ids) == len(keys_to_load), (dst_block_ids, len(keys_to_load))
        params = req_status.req_context.kv_transfer_params
        if not (params is not None and params.get("do_remote_decode")):
            # Loaded blocks are in the tier already: do not store them again.
            req_status.next_stored_block_idx = end_block_idx
        self._loaded_keys_by_block.update(zip(dst_block_ids, keys_to_load, strict=True))
        src_spec = self.manager.prepare_load(keys_to_load, req_status.req_context)
        dst_spec = GPULoadStoreSpec(
            dst_block_ids, group_sizes=[len(dst_block_ids)], block_indices=[start_block_idx]
        )
        job_id = self._generate_job_id()
        self._current_batch_load_jobs[job_id] = TransferJob(
            req_id=request.request_id,
            transfer_spec=(src_spec, dst_spec),
            trace_headers=request.trace_headers,
            block_size=block_size,
        )
        self._jobs[job_id] = TransferJobStatus(request.request_id, keys_to_load, is_store=False)
        if self.load_async:
            self._load_job_ids[request.request_id] = job_id
            self._blocks_being_loaded.update(keys_to_load)

    # ------------------------------------------------------------------ stores
    def _build_store_jobs(self, scheduler_output: SchedulerOutput) -> dict[int, TransferJob]:
        block_size = self.block_size
        store_jobs: dict[int, TransferJob] = {}
        for req_id, new_block_id_groups, preempted in yield_req_data(scheduler_output):
            req_status = self._req_status.get(req_id)
            if req_status is None:
                continue
            req_status.update_offload_keys()
            req = req_status.req
            if preempted:
                req_status.block_ids.clear()
            if new_block_id_groups is not None:
                req_status.block_ids.extend(new_block_id_groups[0])
            num_scheduled_tokens = scheduler_output.num_scheduled_tokens[req_id]
            # The tokens whose KV this step's forward leaves in the cache
            # (drafts beyond the request's tokens are not final).
            num_offloadable_tokens = min(
                req.num_computed_tokens + num_scheduled_tokens, req.num_tokens
            )
            num_blocks = num_offloadable_tokens // block_size
            start_block_idx = req_status.next_stored_block_idx
            if num_blocks <= start_block_idx:
                continue
            offload_keys = req_status.offload_keys[start_block_idx:num_blocks]
            store_output = self.manager.prepare_store(offload_keys, req_status.req_context)
            if store_output is None:
                logger.warning("Request %s: cannot store blocks", req_id)
                continue
            req_status.next_stored_block_idx = num_blocks
            if not store_output.keys_to_store:
                continue
            self.manager.touch(req_status.offload_keys, req_status.req_context)
            keys_to_store = set(store_output.keys_to_store)
            src_block_ids = [
                req_status.block_ids[start_block_idx + i]
                for i, key in enumerate(offload_keys)
                if key in keys_to_store
            ]
            src_spec = GPULoadStoreSpec(
                src_block_ids, group_sizes=[len(src_block_ids)], block_indices=[start_block_idx]
            )
            job_id = self._generate_job_id()
            self._jobs[job_id] = TransferJobStatus(
                req_id, list(store_output.keys_to_store), is_store=True
            )
            store_jobs[job_id] = TransferJob(
                req_id=req_id,
                transfer_spec=(src_spec, store_output.store_spec),
                trace_headers=req.trace_headers,
                block_size=block_size,
            )
            logger.debug(
                "Request %s offloading %d blocks up to %d tokens (job %d)",
                req_id,
                len(src_block_ids),
                num_offloadable_tokens,
                job_id,
            )
        return store_jobs

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> OffloadingConnectorMetadata:
        meta = OffloadingConnectorMetadata(
            load_jobs=self._current_batch_load_jobs,
            store_jobs=self._build_store_jobs(scheduler_output),
        )
        self._current_batch_load_jobs = {}
        # The worker runs these in this step, before any later step's
        # transfer: done, as far as any later decision can tell (an
        # asynchronous load waits for its finished_recving).
        completed = [*meta.store_jobs] if self.load_async else [*meta.load_jobs, *meta.store_jobs]
        for job_id in completed:
            self._complete_job(job_id)
        return meta

    def update_connector_output(
        self, finished_recving: set[str] | None, invalid_block_ids: set[int] | None = None
    ) -> None:
        """Loads the workers report done: their slots may be evicted again,
        their blocks are the engine's (cached by the scheduler). The tier's
        blocks behind a load that failed (``invalid_block_ids``, engine
        blocks) are discarded: otherwise the request, recomputing with no
        local hit, would find them again, load again and fail again, without
        end (or, under policy "fail", every later request with that prefix
        would fail). vLLM's loads never fail."""
        for req_id in finished_recving or ():
            job_id = self._load_job_ids.pop(req_id, None)
            if job_id is None:
                continue
            self._blocks_being_loaded.difference_update(self._jobs[job_id].keys)
            self._complete_job(job_id)
        failed_keys = [
            self._loaded_keys_by_block.pop(block_id)
            for block_id in invalid_block_ids or ()
            if block_id in self._loaded_keys_by_block
        ]
        if failed_keys:
            logger.warning(
                "Discarding %d block(s) from the offload tier: a load from them failed",
                len(failed_keys),
            )
            self.manager.discard(failed_keys, ReqContext(req_id=""))

    def _complete_job(self, job_id: int) -> None:
        job_status = self._jobs.pop(job_id)
        req_status = self._req_status.get(job_status.req_id)
        req_context = (
            req_status.req_context if req_status is not None else ReqContext(job_status.req_id)
        )
        if job_status.is_store:
            self.manager.complete_store(job_status.keys, req_context)
        else:
            self.manager.complete_load(job_status.keys, req_context)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Nothing outlives the request: its stores finished with their steps,
        and a load in flight (an aborted request's) keeps its own blocks until
        it is reported (the scheduler holds them till then)."""
        self._req_status.pop(request.request_id, None)
        return False, None

    def reset_cache(self) -> None:
        self.manager.reset_cache()
        for status in self._req_status.values():
            status.next_stored_block_idx = 0

    def shutdown(self) -> None:
        self.manager.shutdown()
