"""``OffloadingWorker``: the worker's transfers, routed to a handler per direction.

Mirrors vllm/v1/kv_offload/worker/worker.py. A transfer is a job id and a
``TransferSpec`` (source spec, destination spec); the worker hands it to
the ``OffloadingHandler`` registered for (source medium, destination
medium), and ``get_finished`` collects the handlers' ``TransferResult``\\ s.
vLLM's handlers run on CUDA streams and finish later; tracevllm's copy at
once (``transfer_async`` returns with the job done), so a job is finished
by the time the next step is scheduled.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from tracevllm.kv_offload.base import LoadStoreSpec
from tracevllm.logger import init_logger

logger = init_logger(__name__)

# A transfer: (source spec, destination spec).
TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]
# Transfers are routed by (source medium, destination medium).
TransferType = tuple[str, str]


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None  # bytes
    transfer_time: float | None = None  # seconds
    transfer_type: TransferType | None = None


class OffloadingHandler(ABC):
    """Moves KV data one way (tier to engine cache, or back)."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Start a transfer; True if it was submitted."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """The transfers finished since the last call."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until these jobs are finished."""

    def shutdown(self) -> None:
        return


class OffloadingWorker:
    """The handlers by transfer type, and the jobs given to them."""

    def __init__(self) -> None:
        self.handlers: set[OffloadingHandler] = set()
        self.transfer_type_to_handler: dict[TransferType, OffloadingHandler] = {}

    def register_handler(
        self,
        src_cls: type[LoadStoreSpec],
        dst_cls: type[LoadStoreSpec],
        handler: OffloadingHandler,
    ) -> None:
        transfer_type = (src_cls.medium(), dst_cls.medium())
        assert transfer_type not in self.transfer_type_to_handler
        self.handlers.add(handler)
        self.transfer_type_to_handler[transfer_type] = handler

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec
        transfer_type = (src.medium(), dst.medium())
        handler = self.transfer_type_to_handler.get(transfer_type)
        assert handler is not None, f"no handler for {transfer_type}"
        try:
            success = handler.transfer_async(job_id, spec)
        except Exception as e:
            logger.warning("Exception in %r transfer %d: %r", transfer_type, job_id, e)
            return False
        if not success:
            logger.warning("Failed to submit %r transfer %d", transfer_type, job_id)
        return success

    def get_finished(self) -> list[TransferResult]:
        finished: list[TransferResult] = []
        for handler in self.handlers:
            finished.extend(handler.get_finished())
        return finished

    def wait(self, job_ids: set[int]) -> None:
        for handler in self.handlers:
            handler.wait(job_ids)

    def shutdown(self) -> None:
        for handler in self.handlers:
            handler.shutdown()
