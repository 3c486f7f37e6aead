"""What each engine span shows: the ``record`` and ``parent`` functions that
``tracing.instrument`` calls around the engine's methods.

tracevllm's own. Keeping them here keeps the engine's files reading like
vLLM's: a method carries one decorator line, and this file says what its span
records. A ``record(span, result, *args)`` function runs after the method
returned, only when the span records, and is given the method's own
arguments (``self`` first). These functions read the engine's objects but
never import them: tracing never imports the core. One that raises never
reaches the engine: ``instrument`` logs it once and keeps the span without
what it records.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span

from tracevllm.tracing import extract_trace_context, extract_trace_headers
from tracevllm.tracing.attributes import SpanAttributes
from tracevllm.tracing.step_view import (
    record_grammar_bitmask,
    record_schedule,
    record_spec_decode,
)

__all__ = [
    "core_add_request",
    "core_add_request_parent",
    "create_grammar",
    "create_grammar_parent",
    "get_grammar_bitmask",
    "generate_parent",
    "http_parent",
    "prepare_inputs",
    "process_inputs",
    "process_outputs",
    "process_outputs_parent",
    "propose_draft_token_ids",
    "record_schedule",
    "rejection_sample",
    "sample_tokens",
    "step",
    "step_parent",
    "update_from_output",
    "update_states",
]


# --- frontend ---------------------------------------------------------------
def process_inputs(span: Span, request: Any, processor: Any, *args: Any, **kw: Any) -> None:
    span.set_attributes(
        {
            "tracevllm.prompt_token_ids": request.prompt_token_ids,
            "tracevllm.max_tokens": request.sampling_params.max_tokens or 0,
        }
    )


def process_outputs_parent(
    processor: Any, engine_core_outputs: list[Any], *a: Any, **kw: Any
) -> Context | None:
    """Under LLMEngine.step, its parent is that step's span. AsyncLLM's output
    handler runs outside any request: there the batch joins the trace of its
    first traced request (the others are linked, as EngineCore.step does)."""
    if trace.get_current_span().is_recording():
        return None
    for output in engine_core_outputs:
        state = processor.request_states.get(output.request_id)
        if state is not None and state.span is not None:
            return trace.set_span_in_context(state.span.span)
    return None


def process_outputs(
    span: Span, result: Any, processor: Any, engine_core_outputs: list[Any], *a: Any, **kw: Any
) -> None:
    span.set_attributes(
        {
            SpanAttributes.REQUEST_IDS: [o.request_id for o in engine_core_outputs],
            "tracevllm.new_token_ids": [len(o.new_token_ids) for o in engine_core_outputs],
            "tracevllm.finished": [
                o.request_id
                for o in engine_core_outputs
                if o.finish_reason is not None or o.request_id in result.reqs_to_abort
            ],
        }
    )


def generate_parent(*args: Any, trace_headers: Any = None, **kwargs: Any) -> Context | None:
    """AsyncLLM.generate's parent: the context that came with the request
    (the HTTP ``traceparent``, or the server span that carries it)."""
    return extract_trace_context(trace_headers)


def http_parent(handler: Any, request: Any, raw_request: Any) -> Context | None:
    """An OpenAI handler's parent: the client's ``traceparent``, if it sent one."""
    if raw_request is None:
        return None
    return extract_trace_context(extract_trace_headers(raw_request.headers))


# --- engine core --------------------------------------------------------------
def core_add_request_parent(engine_core: Any, request: Any) -> Context | None:
    """EngineCore.add_request's parent: the frontend's llm_request span, whose
    context came over the process boundary in ``trace_headers``."""
    return extract_trace_context(request.trace_headers)


def core_add_request(span: Span, result: Any, engine_core: Any, request: Any) -> None:
    span.set_attributes(
        {
            SpanAttributes.GEN_AI_REQUEST_ID: request.request_id,
            "tracevllm.num_prompt_tokens": request.num_prompt_tokens,
            "tracevllm.num_block_hashes": len(request.block_hashes),
        }
    )


# The trace each engine's last step joined (see step_parent).
_last_step_headers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


# --8<-- [start:step_span]
def step_parent(engine_core: Any) -> Context | None:
    """The ``EngineCore.step`` span joins the trace of the oldest request.

    A step serves many requests but a span has one parent: it joins the
    oldest request's trace and links to every request it served (``step``
    below). A step with no live request (it only tells the runner what
    finished) stays in the trace of the request served last.
    """
    scheduler = engine_core.scheduler
    oldest = next(iter(scheduler.running), None)
    if oldest is None and scheduler.waiting:
        oldest = scheduler.waiting.peek_request()
    if oldest is not None and oldest.trace_headers:
        _last_step_headers[engine_core] = oldest.trace_headers
    return extract_trace_context(_last_step_headers.get(engine_core))


def step(span: Span, result: Any, engine_core: Any) -> None:
    """Link the step to every request it served (finished ones included)."""
    engine_core_outputs, _ = result
    headers = {
        o.request_id: o.trace_headers
        for outputs in engine_core_outputs.values()
        for o in outputs.outputs
        if o.trace_headers
    }
    scheduler = engine_core.scheduler
    served = sorted(scheduler.prev_step_scheduled_req_ids)
    for req_id in served:
        request = scheduler.requests.get(req_id)
        context = extract_trace_context(request.trace_headers if request else headers.get(req_id))
        if context is not None:
            req_span_context = trace.get_current_span(context).get_span_context()
            span.add_link(req_span_context, {SpanAttributes.GEN_AI_REQUEST_ID: req_id})
    span.set_attribute(SpanAttributes.REQUEST_IDS, served)
    _record_num_threads(span, engine_core)


# --8<-- [end:step_span]


def _record_num_threads(span: Span, engine_core: Any) -> None:
    """The torch threads the step's forward ran with (worker/cpu_threads.py
    may change them between steps), where the worker shares this process."""
    if getattr(engine_core.model_executor, "driver_worker", None) is not None:
        import torch  # the engine's process has it; tracing itself does not need it

        span.set_attribute("tracevllm.num_threads", torch.get_num_threads())


def step_with_batch_queue(span: Span, result: Any, engine_core: Any) -> None:
    """Which step this turn scheduled, which one's output it made (-1: none),
    and how many steps were in flight; linked to the requests of both."""
    info = engine_core.batch_queue_info
    span.set_attributes(
        {
            SpanAttributes.STEP_ID: info["scheduled_step_id"],
            "tracevllm.batch_queue.output_step_id": info["output_step_id"],
            "tracevllm.batch_queue.in_flight": info["in_flight"],
            "tracevllm.batch_queue.size": engine_core.batch_queue_size,
        }
    )
    scheduler = engine_core.scheduler
    served = sorted(info["req_ids"])
    for req_id in served:
        request = scheduler.requests.get(req_id)
        context = extract_trace_context(request.trace_headers if request else None)
        if context is not None:
            req_span_context = trace.get_current_span(context).get_span_context()
            span.add_link(req_span_context, {SpanAttributes.GEN_AI_REQUEST_ID: req_id})
    span.set_attribute(SpanAttributes.REQUEST_IDS, served)
    _record_num_threads(span, engine_core)


def update_from_output(
    span: Span, engine_core_outputs: Any, scheduler: Any, so: Any, runner_output: Any
) -> None:
    record_spec_decode(span, scheduler, so, runner_output, engine_core_outputs)
    finished = [
        o.request_id
        for outputs in engine_core_outputs.values()
        for o in outputs.outputs
        if o.finish_reason is not None
    ]
    span.set_attribute("tracevllm.finished_req_ids", sorted(finished))


# --- structured outputs -----------------------------------------------------------
def create_grammar_parent(manager: Any, request: Any) -> Context | None:
    """A compilation runs on a pool thread, where no span is open: it joins
    the trace of the request it compiles for."""
    return extract_trace_context(request.trace_headers)


def create_grammar(span: Span, grammar: Any, manager: Any, request: Any) -> None:
    kind, spec = request.structured_output_request.structured_output_key
    span.set_attributes(
        {
            SpanAttributes.GEN_AI_REQUEST_ID: request.request_id,
            "tracevllm.structured_output.kind": kind.name.lower(),
            "tracevllm.structured_output.spec_chars": len(spec),
            "tracevllm.structured_output.joined": grammar.joined,
            "tracevllm.structured_output.compiler_cache_bytes": grammar.compiler_cache_bytes,
        }
    )


get_grammar_bitmask = record_grammar_bitmask


# --- model runner ---------------------------------------------------------------
def update_states(span: Span, result: Any, runner: Any, scheduler_output: Any) -> None:
    # Rows added this step: new requests, and those not scheduled last step
    # (resumed, or skipped for lack of budget): exactly the ones the scheduler
    # sent whole token lists for.
    cached = scheduler_output.scheduled_cached_reqs
    added = [r.req_id for r in scheduler_output.scheduled_new_reqs] + list(cached.all_token_ids)
    span.set_attributes(
        {
            "tracevllm.added_req_ids": added,
            "tracevllm.batch_req_ids": list(runner.input_batch.req_ids),
        }
    )


def prepare_inputs(span: Span, result: Any, runner: Any, scheduler_output: Any) -> None:
    """Put the flat batch on the span: the arrays the kernels will see."""
    batch = runner.input_batch
    metadata = runner.attn_metadata
    span.set_attributes(
        {
            "tracevllm.req_ids": list(batch.req_ids),
            "tracevllm.num_scheduled_tokens": [
                scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids
            ],
            "tracevllm.input_ids": runner.input_ids.tolist(),
            "tracevllm.positions": runner.positions.tolist(),
            "tracevllm.query_start_loc": runner.query_start_loc.tolist(),
            "tracevllm.seq_lens": runner.seq_lens.tolist(),
            "tracevllm.slot_mapping": runner.slot_mapping.tolist(),
            "tracevllm.logits_indices": runner.logits_indices.tolist(),
            # Each row as "req: block ids", since attributes are flat.
            "tracevllm.block_table": [
                f"{req_id}: {row}"
                for req_id, row in zip(batch.req_ids, metadata.block_table.tolist())
            ],
        }
    )


def sample_tokens(span: Span, output: Any, runner: Any, *args: Any, **kw: Any) -> None:
    if not hasattr(output, "sampled_token_ids"):
        # Async scheduling: the tokens stay on the device for the next step's
        # inputs (read here only when the span records).
        batch = runner.input_batch
        sampled = batch.prev_sampled_token_ids.tolist()
        span.set_attributes(
            {
                "tracevllm.req_ids": list(batch.req_ids),
                "tracevllm.sampled_token_ids": [
                    sampled[i][0] if req_id in batch.prev_req_id_to_index else -1
                    for i, req_id in enumerate(batch.req_ids)
                ],
                "tracevllm.async_scheduling": True,
            }
        )
        return
    span.set_attributes(
        {
            "tracevllm.req_ids": list(output.req_ids),
            # -1: a partial prefill's sample, thrown away.
            "tracevllm.sampled_token_ids": [
                ids[0] if ids else -1 for ids in output.sampled_token_ids
            ],
        }
    )


# --- speculative decoding -----------------------------------------------------
def rejection_sample(
    span: Span, output: Any, sampler: Any, metadata: Any, draft_probs: Any, *a: Any, **kw: Any
) -> None:
    """What the target model made of each request's drafts (rows in batch order)."""
    emitted = [[t for t in row if t >= 0] for row in output.sampled_token_ids.tolist()]
    drafts = metadata.draft_token_ids.tolist()
    starts = [0, *itertools.accumulate(metadata.num_draft_tokens)]
    span.set_attributes(
        {
            "tracevllm.spec_decode.num_draft_tokens": metadata.num_draft_tokens,
            # Drafts per row, flattened with their row's start in ..._starts.
            "tracevllm.spec_decode.draft_token_ids": drafts,
            "tracevllm.spec_decode.num_accepted_tokens": [len(e) - 1 for e in emitted if e],
            "tracevllm.spec_decode.emitted_token_ids": [" ".join(map(str, e)) for e in emitted],
            "tracevllm.spec_decode.has_draft_probs": draft_probs is not None,
            "tracevllm.spec_decode.draft_starts": starts[:-1],
        }
    )


def propose_draft_token_ids(span: Span, drafts: Any, runner: Any, *a: Any, **kw: Any) -> None:
    span.set_attributes(
        {
            "tracevllm.spec_decode.method": runner.speculative_config.method,
            "tracevllm.req_ids": list(runner.input_batch.req_ids),
            "tracevllm.spec_decode.drafts": [" ".join(map(str, d)) for d in drafts],
        }
    )
