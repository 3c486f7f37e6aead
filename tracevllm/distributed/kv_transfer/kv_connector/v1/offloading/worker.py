"""``OffloadingConnectorWorker``: the offload tier's side in each worker.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py.
``register_kv_caches`` builds the tier's handlers over the engine's KV cache
tensors (the spec allocates the tier's region here, in the worker);
``start_kv_transfers`` runs the step's loads before the forward (of
requests waiting in ``WAITING_FOR_REMOTE_KVS``, or, with ``async_load``
false, of the requests it runs); ``get_finished`` runs the
step's stores after it (vLLM queues them for the start of the next step, so
that they overlap the next forward on their CUDA streams; a synchronous
copy gains nothing by waiting), reports asynchronously loaded requests
(``finished_recving``: they run from the next step) and records every
finished transfer: a span in its request's trace (tracing/kv_transfer.py)
and vLLM's transfer stats (bytes and seconds per direction, ``GPU_to_CPU``
and ``CPU_to_GPU``). A load that fails reports its blocks too
(``get_block_ids_with_load_errors``): the scheduler recomputes them or fails
the request (``kv_load_failure_policy``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

from tracevllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from tracevllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    get_async_load,
)
from tracevllm.kv_offload.base import BlockIDsLoadStoreSpec
from tracevllm.kv_offload.worker.worker import OffloadingWorker, TransferResult
from tracevllm.tracing import kv_transfer as kv_transfer_tracing

if TYPE_CHECKING:
    import torch

    from tracevllm.kv_offload.base import OffloadingSpec

CONNECTOR_NAME = "OffloadingConnector"


class OffloadingConnectorWorker:
    def __init__(self, spec: OffloadingSpec) -> None:
        self.spec = spec
        self.worker = OffloadingWorker()
        self.load_async = get_async_load(spec.extra_config)
        self._num_layers = 0
        # job id -> (job, direction, wall-clock start) of transfers submitted this step.
        self._jobs: dict[int, tuple[TransferJob, str, int]] = {}
        self._invalid_block_ids: set[int] = set()
        # Requests whose load ran (or failed) since the last get_finished.
        self._finished_recving: set[str] = set()
        # vLLM's OffloadingConnectorStats: per transfer type, bytes and seconds.
        self.transfer_stats: dict[str, dict[str, float]] = defaultdict(
            lambda: {"total_bytes": 0, "total_time": 0.0, "num_transfers": 0}
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._num_layers = len(kv_caches)
        for src_cls, dst_cls, handler in self.spec.get_handlers(kv_caches):
            self.worker.register_handler(src_cls, dst_cls, handler)

    def _submit(self, job_id: int, job: TransferJob, direction: str) -> None:
        self._jobs[job_id] = (job, direction, time.time_ns())
        if direction == "load" and self.load_async:
            self._finished_recving.add(job.req_id)
        if not self.worker.transfer_async(job_id, job.transfer_spec):
            self._jobs.pop(job_id)
            if direction == "load":
                dst = job.transfer_spec[1]
                assert isinstance(dst, BlockIDsLoadStoreSpec)
                self._invalid_block_ids.update(dst.block_ids)
            self._record(job, direction, None, error="transfer failed")

    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata) -> None:
        """The step's loads, into the engine's cache before the forward reads it."""
        for job_id, job in metadata.load_jobs.items():
            self._submit(job_id, job, "load")

    def store_kv(self, metadata: OffloadingConnectorMetadata) -> None:
        """The step's stores, from the blocks the forward just filled."""
        for job_id, job in metadata.store_jobs.items():
            self._submit(job_id, job, "save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Every transfer is done by now: record each, and report the loads."""
        for result in self.worker.get_finished():
            entry = self._jobs.pop(result.job_id, None)
            if entry is None:
                continue
            job, direction, start_ns = entry
            if not result.success and direction == "load":
                dst = job.transfer_spec[1]
                assert isinstance(dst, BlockIDsLoadStoreSpec)
                self._invalid_block_ids.update(dst.block_ids)
            self._record(job, direction, result, start_ns=start_ns)
        finished_recving, self._finished_recving = self._finished_recving, set()
        return None, finished_recving or None

    def _record(
        self,
        job: TransferJob,
        direction: str,
        result: TransferResult | None,
        start_ns: int = 0,
        error: str | None = None,
    ) -> None:
        src = job.transfer_spec[0]
        assert isinstance(src, BlockIDsLoadStoreSpec)
        num_blocks = len(src.block_ids)
        record = kv_transfer_tracing.KVTransferRecord(
            connector=CONNECTOR_NAME,
            direction=direction,
            request_id=job.req_id,
            trace_headers=job.trace_headers,
            num_blocks=num_blocks,
            num_tokens=num_blocks * job.block_size,
            error=error,
        )
        if result is not None:
            if not result.success:
                record.error = "transfer failed"
            seconds = result.transfer_time or 0.0
            record.num_bytes = result.transfer_size or 0
            record.num_layers = self._num_layers
            record.start_ns = start_ns or time.time_ns()
            record.end_ns = record.start_ns + int(seconds * 1e9)
            if result.transfer_type is not None:
                stats = self.transfer_stats["_to_".join(result.transfer_type)]
                stats["total_bytes"] += record.num_bytes
                stats["total_time"] += seconds
                stats["num_transfers"] += 1
        kv_transfer_tracing.record_kv_transfer(record)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def shutdown(self) -> None:
        self._jobs.clear()
        self.worker.shutdown()
