"""AsyncLLM's failure paths, with the real engine process and the real OTel SDK.

A request that fails in ``generate()`` raises ``EngineGenerateError`` (vLLM's
type; the engine goes on serving), with the error recorded on its
``llm_request`` span before the abort ends it; when the engine dies, every
live request's span ends with status ERROR, and the output handler logs the
traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tracevllm import SamplingParams
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.engine.async_llm import AsyncLLM
from tracevllm.engine.exceptions import EngineDeadError, EngineGenerateError

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _traced_engine(model: str) -> tuple[AsyncLLM, InMemorySpanExporter]:
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=model, num_gpu_blocks_override=64, trace_detail="request")
    )
    assert engine.tracer_provider is not None
    exporter = InMemorySpanExporter()
    engine.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return engine, exporter


async def _collect(outputs: AsyncIterator[Any]) -> list[int]:
    token_ids: list[int] = []
    async for out in outputs:
        token_ids = out.outputs[0].token_ids
    return token_ids


def _request_spans(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {
        s.attributes["gen_ai.request.id"]: s
        for s in exporter.get_finished_spans()
        if s.name == "llm_request"
    }


@pytest.mark.parametrize("n", [1, 3])
def test_a_failed_send_raises_engine_generate_error_and_marks_the_span(
    tiny_model_dir: str, n: int
) -> None:
    """The send of one request fails (its third child for n = 3): generate()
    raises EngineGenerateError from the cause, the request's span ends with
    status ERROR and the exception on it, and the engine serves on, clean."""

    async def run() -> None:
        engine, exporter = _traced_engine(tiny_model_dir)
        try:
            expected = await _collect(engine.generate("Hello", GREEDY, "before"))
            real = engine.engine_core.add_request_async
            sends = iter(range(100))

            async def failing_send(request: Any) -> None:
                if next(sends) == n - 1:
                    raise RuntimeError("the socket said no")
                await real(request)

            engine.engine_core.add_request_async = failing_send  # type: ignore[method-assign]
            params = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, n=n)
            with pytest.raises(EngineGenerateError) as e:
                await _collect(engine.generate("Hello", params, "failing"))
            assert isinstance(e.value.__cause__, RuntimeError)
            engine.engine_core.add_request_async = real  # type: ignore[method-assign]

            span = _request_spans(exporter)["failing"]
            assert span.status.status_code == StatusCode.ERROR
            (event,) = [ev for ev in span.events if ev.name == "exception"]
            assert event.attributes["exception.message"] == "the socket said no"
            # Nothing left behind: the next request is served, every block free.
            assert await _collect(engine.generate("Hello", GREEDY, "after")) == expected
            assert not engine.output_processor.has_unfinished_requests()
            stats = await engine.get_kv_cache_stats()
            assert stats["used"] == 0, stats
            assert _request_spans(exporter)["after"].status.status_code == StatusCode.UNSET
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_engine_death_ends_every_request_span_with_error(
    tiny_model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGKILL of the engine under two running requests: both generate()s
    raise EngineDeadError, both llm_request spans end with status ERROR (the
    error recorded), and the output handler logs it with its traceback."""

    async def run() -> None:
        engine, exporter = _traced_engine(tiny_model_dir)
        try:
            started = asyncio.Event()

            async def one(request_id: str) -> None:
                async for _ in engine.generate("Tell me a story", LONG, request_id):
                    started.set()

            tasks = [asyncio.ensure_future(one(f"r{i}")) for i in range(2)]
            await started.wait()
            os.kill(engine.engine_core.engine_pid, signal.SIGKILL)
            results = await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=30
            )
            assert all(isinstance(r, EngineDeadError) for r in results), results
            spans = _request_spans(exporter)
            for request_id in ("r0", "r1"):
                span = spans[request_id]
                assert span.status.status_code == StatusCode.ERROR
                assert any(ev.name == "exception" for ev in span.events)
        finally:
            engine.shutdown()

    with caplog.at_level(logging.ERROR, logger="tracevllm.engine.async_llm"):
        asyncio.run(run())
    (record,) = [r for r in caplog.records if "output_handler failed" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is EngineDeadError
