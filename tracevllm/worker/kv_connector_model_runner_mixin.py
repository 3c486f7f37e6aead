"""``KVConnectorModelRunnerMixin``: where the model runner hands the KV connector each step.

Mirrors vllm/v1/worker/kv_connector_model_runner_mixin.py. Around the
forward (``maybe_get_kv_connector_output``): bind the scheduler's
``kv_connector_metadata`` to this process's worker-side connector, start its
loads (``start_load_kv``); after the forward, wait for its saves
(``wait_for_save``), collect what finished (``get_finished``) and what failed
to load (``get_block_ids_with_load_errors``) into the step's
``KVConnectorOutput``, and clear the metadata. In between, each attention
layer waits for its load and starts its save (``maybe_transfer_kv_layer`` in
model_executor/layers/attention.py). A step with no tokens to run still
gives the connector its turn (``kv_connector_no_forward``): asynchronous
transfers finish between steps.

tracevllm adds ``initialize_kv_connector``, the two calls vLLM makes from
``Worker.initialize_from_config`` (create the worker-side connector) and
``GPUModelRunner.initialize_kv_cache`` (register the KV cache tensors), and
keys everything on the step's metadata as well as on the process's
connector: an in-process engine without a connector never binds another's.
Left out: cross-layer (uniform) KV cache allocation, deferred finalization
for a draft model's forward, connector stats and KV cache events.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

from tracevllm.distributed.kv_transfer.kv_transfer_state import (
    ensure_kv_transfer_initialized,
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from tracevllm.forward_context import get_forward_context, set_forward_context
from tracevllm.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput

if TYPE_CHECKING:
    import torch

    from tracevllm.config import VllmConfig
    from tracevllm.core.sched.output import SchedulerOutput
    from tracevllm.kv_cache_interface import KVCacheConfig


class KVConnectorModelRunnerMixin:
    # The step's connector output, from execute_model to sample_tokens.
    kv_connector_output: KVConnectorOutput | None = None

    @staticmethod
    def initialize_kv_connector(
        vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor]
    ) -> None:
        """Create this process's worker-side connector (if configured) and
        give it the KV cache tensors, by layer name."""
        if vllm_config.kv_transfer_config is None:
            return
        ensure_kv_transfer_initialized(vllm_config, kv_cache_config)
        if has_kv_transfer_group():
            get_kv_transfer_group().register_kv_caches(kv_caches)

    @staticmethod
    def kv_connector_no_forward(
        scheduler_output: SchedulerOutput, vllm_config: VllmConfig
    ) -> ModelRunnerOutput:
        """Nothing to run this step; the connector still reports what finished."""
        if not _uses_connector(scheduler_output):
            return EMPTY_MODEL_RUNNER_OUTPUT
        with (
            set_forward_context(None, vllm_config),
            KVConnectorModelRunnerMixin._get_kv_connector_output(
                scheduler_output, wait_for_save=False
            ) as kv_connector_output,
        ):
            pass
        if kv_connector_output.is_empty():
            return EMPTY_MODEL_RUNNER_OUTPUT
        return ModelRunnerOutput(
            req_ids=[], req_id_to_index={}, kv_connector_output=kv_connector_output
        )

    @staticmethod
    def maybe_get_kv_connector_output(
        scheduler_output: SchedulerOutput,
    ) -> AbstractContextManager[KVConnectorOutput | None]:
        """Around the forward (inside its forward context); yields None without a connector."""
        if not _uses_connector(scheduler_output):
            return nullcontext()
        return KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output)

    # --8<-- [start:get_kv_connector_output]
    @staticmethod
    @contextmanager
    def _get_kv_connector_output(
        scheduler_output: SchedulerOutput, wait_for_save: bool = True
    ) -> Iterator[KVConnectorOutput]:
        """The connector's whole turn in one step: bind and start loads, run
        the forward (the caller's block), wait for saves, report."""
        output = KVConnectorOutput()
        kv_connector = get_kv_transfer_group()
        assert scheduler_output.kv_connector_metadata is not None
        kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        # Loads that do not depend on a layer start here, before the forward.
        kv_connector.start_load_kv(get_forward_context())
        try:
            yield output
        finally:
            if wait_for_save:
                kv_connector.wait_for_save()
            output.finished_sending, output.finished_recving = kv_connector.get_finished(
                scheduler_output.finished_req_ids
            )
            output.invalid_block_ids = kv_connector.get_block_ids_with_load_errors()
            kv_connector.clear_connector_metadata()

    # --8<-- [end:get_kv_connector_output]

    def take_kv_connector_output(self) -> KVConnectorOutput | None:
        """This step's connector output, once (sample_tokens puts it on the step's output)."""
        output, self.kv_connector_output = self.kv_connector_output, None
        return output


def _uses_connector(scheduler_output: SchedulerOutput) -> bool:
    """This engine has a connector: its scheduler sent metadata, and the
    process has the worker-side connector."""
    return scheduler_output.kv_connector_metadata is not None and has_kv_transfer_group()
