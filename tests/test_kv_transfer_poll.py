"""An engine core whose only work is pending KV transfers polls the connector
at KV_TRANSFER_POLL_S instead of stepping without pause (tracevllm's; vLLM's
busy loop spins). A producer holds a finished request's blocks until a remote
reader has them (NixlConnector: up to TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT,
480 s): spinning meant a busy core and a step span per turn for that long."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tracevllm import LLM, SamplingParams
from tracevllm.core.kv_cache_manager import KVCacheBlocks
from tracevllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from tracevllm.engine import core as engine_core
from tracevllm.request import Request


class HoldingConnector(KVConnectorBase_V1):
    """Every finished request's blocks held for a reader that never comes."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return True, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...


@pytest.mark.timeout(120)
def test_a_core_holding_blocks_for_a_reader_polls_instead_of_spinning(
    tiny_model_dir: str,
) -> None:
    llm = LLM(
        model=tiny_model_dir,
        enable_multiprocessing=False,
        num_gpu_blocks_override=32,
        kv_transfer_config={
            "kv_connector": "HoldingConnector",
            "kv_connector_module_path": "tests.test_kv_transfer_poll",
            "kv_role": "kv_both",
        },
    )
    try:
        llm.generate([{"prompt_token_ids": list(range(1, 40))}], SamplingParams(max_tokens=2))
        core = llm.llm_engine.engine_core.engine_core
        # The request is done, its blocks held: the core still has work.
        assert core.scheduler.has_requests() and not core.scheduler.has_unfinished_requests()
        window = 0.5
        steps, start = 0, time.monotonic()
        while time.monotonic() - start < window:
            core.step_fn()
            steps += 1
        # It keeps polling (the connector's get_finished runs in each step),
        # at most once per KV_TRANSFER_POLL_S. (Mutation caught: the pause
        # removed -> thousands of steps in the window.)
        assert 2 <= steps <= window / engine_core.KV_TRANSFER_POLL_S + 2, steps
    finally:
        llm.shutdown()
