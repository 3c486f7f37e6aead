"""One worker, in EngineCore's own process.

Mirrors vllm/v1/executor/uniproc_executor.py (``UniProcExecutor``): the
executor for ``tensor_parallel_size = pipeline_parallel_size = 1``. It still
goes through a ``Worker`` and ``collective_rpc`` (a plain call here), and
the worker still sets up a world of one process, so the model's layers ask
the same process groups whatever the executor. With async scheduling it
keeps two steps in the batch queue, as vLLM's: on a GPU the forward runs
on while the CPU schedules the next step; on CPU the call returns when the
step is done, so the two do not overlap (the ``mp`` backend's workers do).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tracevllm.distributed.utils import temporary_file_init_method
from tracevllm.executor.abstract import Executor
from tracevllm.logger import init_logger
from tracevllm.outputs import AsyncModelRunnerOutput
from tracevllm.serial_utils import run_method
from tracevllm.worker.worker_base import WorkerWrapperBase

logger = init_logger(__name__)

if TYPE_CHECKING:
    from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput
    from tracevllm.outputs import DraftTokenIds, ModelRunnerOutput
    from tracevllm.worker.model_runner import ModelRunner


class AsyncOutputFuture(Future):  # type: ignore[type-arg]
    """The Future of an async step's output: waits for it when asked (vLLM's)."""

    def __init__(self, async_output: AsyncModelRunnerOutput, single_value: bool) -> None:
        self.async_output = async_output
        self.single_value = single_value
        super().__init__()

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            raise RuntimeError("timeout not implemented")
        if not super().done():
            try:
                output = self.async_output.get_output()
                self.set_result(output if self.single_value else [output])
            except Exception as e:
                self.set_exception(e)
        return super().result()


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        """Make the worker, its device and its model."""
        self.driver_worker = WorkerWrapperBase(rpc_rank=0)
        device_info = self.vllm_config.device_config.device.split(":")
        local_rank = int(device_info[1]) if len(device_info) > 1 else 0
        # vLLM gives the world of one a tcp:// address on an open port; a
        # file needs no port, and is gone once the groups are made.
        with temporary_file_init_method() as distributed_init_method:
            kwargs = dict(
                vllm_config=self.vllm_config,
                local_rank=local_rank,
                rank=0,
                distributed_init_method=distributed_init_method,
                is_driver_worker=True,
            )
            self.driver_worker.init_worker(all_kwargs=[kwargs])
            try:
                self.driver_worker.init_device()
                self.driver_worker.load_model()
            except BaseException:
                try:
                    self.driver_worker.shutdown()  # what init_device took, given back
                except Exception:
                    logger.exception("Shutting the worker down after a failed start failed too")
                raise

    @property
    def model_runner(self) -> ModelRunner:
        """The worker's runner (a shortcut for tests and views, in-process only)."""
        runner = self.driver_worker.model_runner
        assert runner is not None
        return runner

    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        single_value: bool = False,
    ) -> Any:
        """A plain call on the one worker (``timeout`` cannot apply in-process)."""
        kwargs = kwargs or {}
        if not non_block:
            result = run_method(self.driver_worker, method, args, kwargs)
            return result if single_value else [result]
        future: Future[Any] = Future()
        try:
            result = run_method(self.driver_worker, method, args, kwargs)
            if isinstance(result, AsyncModelRunnerOutput):
                return AsyncOutputFuture(result, single_value)
            future.set_result(result if single_value else [result])
        except Exception as e:
            future.set_exception(e)
        return future

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        return self.collective_rpc(
            "execute_model", args=(scheduler_output,), non_block=non_block, single_value=True
        )

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        return self.collective_rpc(
            "sample_tokens", args=(grammar_output,), non_block=non_block, single_value=True
        )

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.collective_rpc("take_draft_token_ids", single_value=True)

    @property
    def max_concurrent_batches(self) -> int:
        return 2 if self.scheduler_config.async_scheduling else 1

    def check_health(self) -> None:
        # Healthy as long as it runs: it is this process.
        return

    def shutdown(self) -> None:
        if worker := getattr(self, "driver_worker", None):
            worker.shutdown()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True
