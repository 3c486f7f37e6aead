"""What the ``OffloadingConnector``'s scheduler side sends its worker side each step.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py:
transfer jobs keyed by the scheduler's job ids, loads (tier to engine
cache, before the forward) and stores (engine cache to tier, after it).
tracevllm adds to each job what its span needs (the request's trace
headers, the block size). Left out: ``jobs_to_flush`` and the worker's
``OffloadingWorkerMetadata`` (every job here is done within its step, so
there is never one to wait for or report).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tracevllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from tracevllm.kv_offload.worker.worker import TransferSpec

ReqId = str


@dataclass
class TransferJob:
    """One request's load or store: (source, destination) blocks."""

    req_id: ReqId
    transfer_spec: TransferSpec
    # tracevllm: the request's trace, for the transfer's span.
    trace_headers: Mapping[str, str] | None = None
    block_size: int = 0


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    # Keyed by scheduler-assigned job ids.
    load_jobs: dict[int, TransferJob] = field(default_factory=dict)
    store_jobs: dict[int, TransferJob] = field(default_factory=dict)
