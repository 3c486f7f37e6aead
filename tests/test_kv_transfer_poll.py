"""An engine core whose only work is pending KV transfers polls the connector
at KV_TRANSFER_POLL_S instead of stepping without pause (tracevllm's; vLLM's
busy loop spins). A producer holds a finished request's blocks until a remote
reader has them (NixlConnector: up to TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT,
480 s): spinning meant a busy core and a step span per turn for that long."""

from __future__ import annotations

import time
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tracevllm import LLM, SamplingParams, tracing
from tracevllm.core.kv_cache_manager import KVCacheBlocks
from tracevllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from tracevllm.engine import core as engine_core
from tracevllm.request import Request
from tracevllm.tracing.attributes import SpanAttributes


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


def _traced_llm(model: str, connector: str, role: str) -> tuple[LLM, InMemorySpanExporter]:
    """An in-process engine with one of this file's connectors, its spans kept."""
    llm = LLM(
        model=model,
        enable_multiprocessing=False,
        num_gpu_blocks_override=32,
        trace_detail="request",
        kv_transfer_config={
            "kv_connector": connector,
            "kv_connector_module_path": "tests.test_kv_transfer_poll",
            "kv_role": role,
        },
    )
    exporter = InMemorySpanExporter()
    provider = llm.llm_engine.tracer_provider
    assert provider is not None
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return llm, exporter


@pytest.mark.timeout(120)
def test_a_core_holding_blocks_for_a_reader_polls_instead_of_spinning(
    tiny_model_dir: str,
) -> None:
    llm, exporter = _traced_llm(tiny_model_dir, "HoldingConnector", "kv_both")
    try:
        llm.generate([{"prompt_token_ids": list(range(1, 40))}], SamplingParams(max_tokens=2))
        assert _step_spans(exporter) >= 2  # the request's steps are traced
        core = llm.llm_engine.engine_core.engine_core
        # The request is done, its blocks held: the core still has work.
        assert core.scheduler.has_requests() and not core.scheduler.has_unfinished_requests()
        core.step_fn()  # the step that tells the runner the request finished
        steps_before_polls = _step_spans(exporter)
        window = 0.5
        steps, start = 0, time.monotonic()
        while time.monotonic() - start < window:
            core.step_fn()
            steps += 1
        # It keeps polling (the connector's get_finished runs in each step),
        # at most once per KV_TRANSFER_POLL_S. (Mutation caught: the pause
        # removed -> thousands of steps in the window.)
        assert 2 <= steps <= window / engine_core.KV_TRANSFER_POLL_S + 2, steps
        # A poll schedules nothing: no span, neither the step's nor its
        # children's (mutation caught: the poll traced -> a step span each).
        assert _step_spans(exporter) == steps_before_polls
    finally:
        llm.shutdown()


class LoadingConnector(HoldingConnector):
    """Each request's first 16 tokens loaded asynchronously: the load is
    reported done by the worker's third get_finished after it starts."""

    loading: dict[str, int] = {}  # shared by the scheduler's and the worker's instance

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if num_computed_tokens or request.request_id in self.loading:
            return 0, False
        return 16, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            self.loading[request.request_id] = 0

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = set()
        for req_id in self.loading:
            self.loading[req_id] += 1
            if self.loading[req_id] == 3:
                done.add(req_id)
        return None, done


@pytest.mark.timeout(120)
def test_the_step_after_a_load_is_in_is_traced(tiny_model_dir: str) -> None:
    """Polls while a load is in flight make no span, but the step that runs
    the loaded request is traced like any other: each step that served the
    request has its span (mutation caught: the request whose load is in
    counted as still waiting -> its first step a silent poll, 1 span not 2)."""
    LoadingConnector.loading.clear()  # a class attribute: a rerun's too
    llm, exporter = _traced_llm(tiny_model_dir, "LoadingConnector", "kv_consumer")
    try:
        (output,) = llm.generate(
            [{"prompt_token_ids": list(range(1, 40))}],
            SamplingParams(max_tokens=2, ignore_eos=True),
        )
        assert output.num_cached_tokens == 16  # it was loaded
        served = [
            s
            for s in exporter.get_finished_spans()
            if s.name == "EngineCore.step" and (s.attributes or {}).get(SpanAttributes.REQUEST_IDS)
        ]
        # The rest of the prompt (sampling the first token), then the second.
        assert len(served) == 2
    finally:
        llm.shutdown()


def _step_spans(exporter: InMemorySpanExporter) -> int:
    names = [s.name for s in exporter.get_finished_spans()]
    assert names.count("EngineCore.step") == names.count("Scheduler.schedule")
    return names.count("EngineCore.step")


def test_untraced_makes_no_span_here_nor_in_the_process_it_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tracing.untraced(): an instrumented method makes no span, and the
    traceparent injected for a worker process carries a parent that is not
    sampled, so that the worker's spans do not record either; a span with an
    explicit parent (a request's) still records. (Mutations caught: the
    instrument wrapper not checking the flag -> a span; a sampled parent ->
    the sampled flag set.)"""
    from opentelemetry.sdk.trace import TracerProvider

    class Traced:
        @tracing.instrument("Traced.call")
        def call(self) -> str:
            return tracing.inject_trace_context()["traceparent"]

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing._state, "provider", provider)
    monkeypatch.setattr(tracing._state, "tracer", provider.get_tracer("tracevllm"))
    request = provider.get_tracer("t").start_span("llm_request")
    request_headers = tracing.inject_trace_context(tracing.trace.set_span_in_context(request))
    with tracing.untraced():
        traceparent = Traced().call()
        with tracing.trace_context({"traceparent": traceparent}):  # the worker's side
            worker_span = provider.get_tracer("w").start_span("worker")
            assert not worker_span.is_recording()
            worker_span.end()
            # A transfer of a request without trace headers gets a trace of
            # its own, here and in the worker (mutation caught by
            # test_each_transfer_is_a_span_on_its_engine: the send spans lost).
            assert tracing.own_trace_if_untraced() is not None
        assert tracing.own_trace_if_untraced() is not None
        load = provider.get_tracer("t").start_span(
            "kv_load", context=tracing.extract_trace_context(request_headers)
        )
        assert load.is_recording()
        load.end()
    request.end()
    assert not _sampled(traceparent)
    assert [s.name for s in exporter.get_finished_spans()] == ["kv_load", "llm_request"]
    assert _sampled(Traced().call())  # outside the block: traced again
    assert tracing.own_trace_if_untraced() is None
    assert "Traced.call" in [s.name for s in exporter.get_finished_spans()]


def _sampled(traceparent: str) -> bool:
    """The W3C trace-flags' sampled bit."""
    return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)
