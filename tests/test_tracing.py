"""Tracing: the spans of DESIGN.md §3, nested as the code nests, one trace
across two processes, and files that load."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rich.console import Console

from tracevllm import LLM, SamplingParams
from tracevllm.tracing.exporters import read_spans_jsonl, to_perfetto

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPTS = ["Hello there, how", "The capital of France is"]


def _inproc_spans(tiny_model_dir: str, detail: str) -> list[Any]:
    exporter = InMemorySpanExporter()
    with LLM(model=tiny_model_dir, enable_multiprocessing=False, trace_detail=detail) as llm:
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return list(exporter.get_finished_spans())


def test_inprocess_span_tree(tiny_model_dir: str) -> None:
    spans = _inproc_spans(tiny_model_dir, "request")
    by_id = {s.context.span_id: s for s in spans}
    names = Counter(s.name for s in spans)

    def parent_name(span: Any) -> str | None:
        return (
            by_id[span.parent.span_id].name
            if span.parent and span.parent.span_id in by_id
            else None
        )

    for required in (
        "LLM.generate",
        "llm_request",
        "LLMEngine.add_request",
        "InputProcessor.process_inputs",
        "InprocClient.add_request",
        "EngineCore.add_request",
        "EngineCore.step",
        "Scheduler.schedule",
        "ModelRunner.execute_model",
        "ModelRunner._update_states",
        "ModelRunner._prepare_inputs",
        "LlamaForCausalLM.forward",
        "reshape_and_cache_flash",
        "unified_attention",
        "ModelRunner.sample_tokens",
        "Sampler.forward",
        "Scheduler.update_from_output",
        "LLMEngine.step",
        "OutputProcessor.process_outputs",
    ):
        assert names[required] > 0, f"no {required} span"
    assert names["llm_request"] == 2
    # Nested as the code nests.
    expected_parents = {
        "llm_request": "LLM.generate",
        "LLMEngine.add_request": "llm_request",
        "InputProcessor.process_inputs": "LLMEngine.add_request",
        "EngineCore.add_request": "llm_request",
        "EngineCore.step": "llm_request",
        "Scheduler.schedule": "EngineCore.step",
        "ModelRunner.execute_model": "EngineCore.step",
        "ModelRunner._prepare_inputs": "ModelRunner.execute_model",
        "LlamaForCausalLM.forward": "ModelRunner.execute_model",
        "reshape_and_cache_flash": "LlamaForCausalLM.forward",
        "Sampler.forward": "ModelRunner.sample_tokens",
        "OutputProcessor.process_outputs": "LLMEngine.step",
    }
    for span in spans:
        if span.name in expected_parents:
            assert parent_name(span) == expected_parents[span.name], span.name
    # At detail "request" the KV write/read is traced for one layer only.
    assert {s.attributes["tracevllm.layer"] for s in spans if s.name == "unified_attention"} == {0}
    launches = {s.attributes["tracevllm.attention.launch"] for s in spans
                if s.name == "unified_attention"}  # fmt: skip
    # The default CPU backend (cpu_attn) names its kernel; the reference its op.
    from kernels.cpu_attn import cpu_kernels_available

    default_launch = (
        "cpu_attention_with_kv_cache" if cpu_kernels_available() else "unified_attention_torch"
    )
    assert {launch.split()[0] for launch in launches} == {default_launch}
    assert names["LlamaDecoderLayer.forward"] == 0
    # One trace for the whole generate call; every span has its code location.
    assert len({s.context.trace_id for s in spans}) == 1
    for span in spans:
        if span.name != "llm_request":
            assert span.attributes.get("code.function.name"), span.name
            assert span.attributes.get("code.file.path", "").startswith(("tracevllm", "kernels"))
            assert span.attributes.get("code.line.number", 0) > 0


def test_inprocess_span_attributes(tiny_model_dir: str) -> None:
    spans = _inproc_spans(tiny_model_dir, "request")
    req = [s for s in spans if s.name == "llm_request"]
    for s in req:
        a = s.attributes
        assert a["gen_ai.usage.output_tokens"] == 5 == a["gen_ai.usage.completion_tokens"]
        assert a["gen_ai.usage.input_tokens"] > 0
        assert list(a["gen_ai.response.finish_reasons"]) == ["length"]
        # As vLLM's do_tracing: request parameters only when truthy (greedy: no temperature).
        assert a["gen_ai.request.max_tokens"] == 5 and "gen_ai.request.temperature" not in a
        assert a["gen_ai.request.n"] == 1 and a["gen_ai.request.top_p"] == 1.0
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        assert a["gen_ai.latency.time_in_queue"] >= 0
        prefill = a["gen_ai.latency.time_in_model_prefill"]
        decode = a["gen_ai.latency.time_in_model_decode"]
        assert prefill > 0 and decode > 0
        assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(prefill + decode)
        assert len(a["tracevllm.latency.inter_token_ms"]) == 4
    first = next(s for s in spans if s.name == "Scheduler.schedule")
    assert first.attributes["tracevllm.token_budget.used"] == sum(
        first.attributes["tracevllm.num_scheduled_tokens"]
    )
    assert first.attributes["tracevllm.token_budget.total"] == 4096
    view = json.loads(first.attributes["tracevllm.view.step"])
    assert {r["kind"] for r in view["requests"]} == {"new"}
    assert view["kv"]["used"] + view["kv"]["free"] == view["kv"]["total"]
    prep = next(s for s in spans if s.name == "ModelRunner._prepare_inputs")
    slots = list(prep.attributes["tracevllm.slot_mapping"])
    assert len(slots) == len(prep.attributes["tracevllm.input_ids"])
    assert list(prep.attributes["tracevllm.positions"])[:3] == [0, 1, 2]
    sampled = [s for s in spans if s.name == "ModelRunner.sample_tokens"]
    assert all(len(s.attributes["tracevllm.sampled_token_ids"]) >= 1 for s in sampled)
    # A step links to every request it served.
    step = next(s for s in spans if s.name == "EngineCore.step")
    assert len(step.links) == 2


def test_request_span_sums_whole_streamed_completions(tiny_model_dir: str) -> None:
    """DELTA outputs carry a few tokens each; the span still counts whole completions,
    and an n=2 request's one span ends once, after both children, with both."""
    from tracevllm.sampling_params import RequestOutputKind

    exporter = InMemorySpanExporter()
    delta = RequestOutputKind.DELTA
    with LLM(model=tiny_model_dir, enable_multiprocessing=False, trace_detail="request") as llm:
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        engine = llm.llm_engine
        one = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=delta)
        engine.add_request("one", PROMPTS[0], one)
        two = SamplingParams(
            n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True, output_kind=delta
        )
        engine.add_request("two", PROMPTS[1], two)
        texts: defaultdict[tuple[str, int], str] = defaultdict(str)
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    texts[(out.request_id, c.index)] += c.text
    spans = {s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans()
             if s.name == "llm_request"}  # fmt: skip
    one, two_span = spans["one"].attributes, spans["two"].attributes
    assert one["gen_ai.usage.output_tokens"] == 5
    assert one["tracevllm.completion.text"] == texts[("one", 0)]
    assert two_span["gen_ai.usage.output_tokens"] == 2 * 4
    assert list(two_span["gen_ai.response.finish_reasons"]) == ["length", "length"]
    assert two_span["tracevllm.completion.text"] == "\n---\n".join(
        [texts[("two", 0)], texts[("two", 1)]]
    )


def test_stopped_requests_report_stop_not_abort(tiny_model_dir: str) -> None:
    """FinishReason.STOP is 0, a falsy value: a request that stopped (on a stop
    token in the core, or a stop string in the frontend) must still say "stop"
    on its span and in the completion view, not "abort"."""
    from tracevllm.views.completion import render_completion

    exporter = InMemorySpanExporter()
    with LLM(model=tiny_model_dir, enable_multiprocessing=False, trace_detail="request") as llm:
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        first = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0]
        stop_string = llm.get_tokenizer().decode(first.token_ids[2:3])
        outs = llm.generate(
            PROMPTS[:1] * 2,
            [
                SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[first.token_ids[1]]),
                SamplingParams(temperature=0.0, max_tokens=5, stop=[stop_string]),
            ],
            use_tqdm=False,
        )
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "stop"]
    spans = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
    stopped = [s.attributes for s in spans if s.attributes["gen_ai.request.id"] in "12"]
    assert [list(a["gen_ai.response.finish_reasons"]) for a in stopped] == [["stop"], ["stop"]]
    console = Console(record=True, width=100, file=io.StringIO())
    console.print(render_completion(dict(stopped[0])))
    assert re.search(r"finish reason\s+stop", console.export_text())


def test_full_detail_adds_every_layer(tiny_model_dir: str) -> None:
    spans = _inproc_spans(tiny_model_dir, "full")
    layers = {s.attributes["tracevllm.layer"] for s in spans if s.name == "unified_attention"}
    assert layers == {0, 1}  # the tiny model has two layers
    assert any(s.name == "LlamaDecoderLayer.forward" for s in spans)
    # The step's arrays are the same for every layer: only layer 0 carries them.
    step_arrays = ("tracevllm.slot_mapping", "tracevllm.query_start_loc", "tracevllm.seq_lens")
    for span in spans:
        if span.name in ("reshape_and_cache_flash", "unified_attention"):
            layer = span.attributes["tracevllm.layer"]
            assert span.attributes["tracevllm.layer_name"] == f"model.layers.{layer}.self_attn.attn"
            arrays = {k for k in step_arrays if k in span.attributes}
            expected = {"reshape_and_cache_flash": {"tracevllm.slot_mapping"},
                        "unified_attention": set(step_arrays[1:])}[span.name]  # fmt: skip
            assert arrays == (expected if layer == 0 else set()), (span.name, layer)
            if layer == 0 and span.name == "reshape_and_cache_flash":
                assert len(span.attributes["tracevllm.slot_mapping"]) > 0
    # Made after the forward from records (tracing.forward_spans), the spans
    # still nest as the code does and carry the times the code ran.
    by_id = {s.context.span_id: s for s in spans}

    def children(span: Any) -> list[Any]:
        inside = [s for s in spans if s.parent and s.parent.span_id == span.context.span_id]
        return sorted(inside, key=lambda s: s.start_time)

    for forward in (s for s in spans if s.name == "LlamaForCausalLM.forward"):
        layers = [s for s in children(forward) if s.name == "LlamaDecoderLayer.forward"]
        assert [s.attributes["tracevllm.layer"] for s in layers] == [0, 1]
        assert forward.start_time <= layers[0].start_time
        assert layers[0].end_time <= layers[1].start_time and layers[1].end_time <= forward.end_time
        for layer in layers:
            inside = children(layer)
            write, read = inside
            assert (write.name, read.name) == ("reshape_and_cache_flash", "unified_attention")
            assert {s.attributes["tracevllm.layer"] for s in inside} == {
                layer.attributes["tracevllm.layer"]
            }
            assert layer.start_time <= write.start_time <= write.end_time <= read.start_time
            assert read.start_time < read.end_time <= layer.end_time
            assert by_id[layer.parent.span_id] is forward
            assert write.context.trace_id == forward.context.trace_id


def test_forward_spans_are_made_as_the_forward_ends() -> None:
    """Inside ``forward_spans`` a span is only timed; the spans appear when the
    forward ends, nested, in the order they ended, and an exception is on the
    spans it went through as ``start_as_current_span`` would put it (not a
    KeyboardInterrupt). A forward inside one joins it; another thread's spans
    are its own; with tracing off nothing is timed."""
    import threading

    from opentelemetry.trace import StatusCode

    from tracevllm import tracing
    from tracevllm.config import TraceConfig

    assert not tracing.is_enabled()
    with tracing.forward_spans(), tracing.span("off", {}):
        assert not tracing.current_span().is_recording()
    exporter = InMemorySpanExporter()
    tracing.init_tracer(
        "engine_core", TraceConfig(detail="full"), span_processors=[SimpleSpanProcessor(exporter)]
    )
    elsewhere: list[Any] = []

    def other_thread() -> None:
        with tracing.span("other thread", {}):
            elsewhere.append(tracing.current_span())

    caller_attributes = {"n": 1}
    try:
        tracer = tracing.get_tracer()
        with tracer.start_as_current_span("forward") as forward:
            with pytest.raises(ValueError), tracing.forward_spans():
                with tracing.span("layer", {"n": 0}):
                    with tracing.span("write", {"n": 0}):
                        pass
                    with tracing.span("read", {"n": 0}):
                        assert exporter.get_finished_spans() == ()  # not made yet
                        thread = threading.Thread(target=other_thread)
                        thread.start()
                        thread.join()
                        with tracing.forward_spans(), tracing.span("inner", {}):  # joins
                            pass
                with tracing.span("layer", {"n": 1}), tracing.span("read", caller_attributes):
                    tracing.current_span().set_attribute("tag", "x")
                    raise ValueError("boom")
            with (
                pytest.raises(KeyboardInterrupt),
                tracing.forward_spans(),
                tracing.span("interrupted", {}),
            ):
                raise KeyboardInterrupt
            with tracing.span("after", {}):  # outside the forward: made at once
                pass
            assert exporter.get_finished_spans()[-1].name == "after"
    finally:
        tracing.shutdown_tracer()
    spans = exporter.get_finished_spans()
    assert [(s.name, s.attributes.get("n")) for s in spans] == [
        ("other thread", None), ("write", 0), ("inner", None), ("read", 0), ("layer", 0),
        ("read", 1), ("layer", 1), ("interrupted", None), ("after", None), ("forward", None),
    ]  # fmt: skip
    assert elsewhere[0] is not None and elsewhere[0].get_span_context().is_valid
    by_id = {s.context.span_id: s for s in spans}
    parent = {(s.name, s.attributes.get("n")): by_id[s.parent.span_id].name for s in spans[1:-1]}
    assert parent == {
        ("write", 0): "layer", ("inner", None): "read", ("read", 0): "layer",
        ("layer", 0): "forward", ("read", 1): "layer", ("layer", 1): "forward",
        ("interrupted", None): "forward", ("after", None): "forward",
    }  # fmt: skip
    assert by_id[spans[5].parent.span_id] is spans[6]  # layer 1's read is in layer 1
    assert by_id[spans[2].parent.span_id] is spans[3]  # the inner forward's span, in read 0
    assert all(s.context.trace_id == forward.get_span_context().trace_id for s in spans[1:])
    assert spans[5].attributes["tag"] == "x" and caller_attributes == {"n": 1}
    for s in spans[1:8]:
        failed = s.attributes.get("n") == 1
        assert (s.status.status_code == StatusCode.ERROR) == failed, s.name
        assert [e.name for e in s.events] == (["exception"] if failed else [])
        for event in s.events:  # stamped inside the span, traced from where it was raised
            assert s.start_time <= event.timestamp <= s.end_time
            assert "raise ValueError" in event.attributes["exception.stacktrace"]
            assert "in forward_spans\n" not in event.attributes["exception.stacktrace"]
    assert spans[5].status.description == "ValueError: boom"


def test_a_record_or_parent_that_raises_is_logged_once_and_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A span's ``record`` or ``parent`` that raises costs the span its
    attributes (all of them: none is left half-written) or its parent, and
    one warning per function; the traced method's result is returned, and
    the method's own exception still reaches its caller."""
    from opentelemetry import trace

    from tracevllm import tracing
    from tracevllm.config import TraceConfig
    from tracevllm.tracing.attributes import SpanAttributes

    def half_then_raise(span: Any, result: Any, value: int) -> None:
        span.set_attribute("first", value)
        span.add_link(trace.INVALID_SPAN_CONTEXT, {"x": 1})
        raise KeyError("missing")

    def bad_parent(value: int) -> Any:
        raise RuntimeError("no parent")

    def good(span: Any, result: Any, value: int) -> None:
        span.set_attributes({"value": value, "result": result})

    @tracing.instrument("T.fails", parent=bad_parent, record=half_then_raise)
    def fails(value: int) -> int:
        return value + 1

    @tracing.instrument("T.raises", record=half_then_raise)
    def raises(value: int) -> int:
        raise ValueError("the method's own")

    @tracing.instrument("T.good", record=good)
    def fine(value: int) -> int:
        return value * 2

    exporter = InMemorySpanExporter()
    tracing.init_tracer(
        "engine_core",
        TraceConfig(detail="request"),
        span_processors=[SimpleSpanProcessor(exporter)],
    )
    try:
        with (
            caplog.at_level("WARNING", logger="tracevllm.tracing"),
            tracing.get_tracer().start_as_current_span("outer"),
        ):
            assert [fails(i) for i in range(3)] == [1, 2, 3]
            assert fine(4) == 8
            with pytest.raises(ValueError, match="the method's own"):
                raises(5)
    finally:
        tracing.shutdown_tracer()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    failed = [s for s in exporter.get_finished_spans() if s.name == "T.fails"]
    assert len(failed) == 3
    for span in failed:
        assert "first" not in span.attributes and not span.links
        assert span.attributes[SpanAttributes.RECORD_ERROR] == "KeyError: 'missing'"
        assert span.parent.span_id == spans["outer"].context.span_id  # the current span
        assert span.status.is_ok
    assert spans["T.good"].attributes["value"] == 4 and spans["T.good"].attributes["result"] == 8
    assert spans["T.raises"].status.description == "ValueError: the method's own"
    assert SpanAttributes.RECORD_ERROR not in spans["T.raises"].attributes  # never recorded
    messages = [r.getMessage() for r in caplog.records if r.name == "tracevllm.tracing"]
    assert len(messages) == 2, messages  # once for the record, once for the parent
    assert any("half_then_raise of span T.fails raised KeyError" in m for m in messages)
    assert any("bad_parent of span T.fails raised RuntimeError" in m for m in messages)


# A record function with a bug, in a real engine core process: the decorator
# holds the function object, so its code is replaced (at the top of the
# script, so that a spawned engine process, which imports it again, has it too).
BROKEN_RECORD = """
import sys
from tracevllm.tracing import step_view

def record_schedule(span, so, scheduler):
    raise RuntimeError("a bug in a record function")

step_view.record_schedule.__code__ = record_schedule.__code__

if __name__ == "__main__":
    from tracevllm import LLM, SamplingParams

    with LLM(model=sys.argv[1], enable_multiprocessing=True, trace_detail="request",
             trace_dir=sys.argv[2]) as llm:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outputs = llm.generate(["Hello there", "The capital of"], params, use_tqdm=False)
        print("ENGINE", llm.llm_engine.engine_core.engine_pid)
    print("TOKENS", [len(o.outputs[0].token_ids) for o in outputs])
"""


def test_a_record_that_raises_does_not_kill_the_engine_core(
    tiny_model_dir: str, tmp_path: Any
) -> None:
    """The broken record of ``Scheduler.schedule`` runs at every step of a
    real engine core process: generation completes, one warning says so, and
    every Scheduler.schedule span is kept with the error in place of its
    attributes (the other spans keep theirs)."""
    script = tmp_path / "broken_record.py"
    script.write_text(BROKEN_RECORD)
    result = subprocess.run(
        [sys.executable, str(script), tiny_model_dir, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TOKENS [6, 6]" in result.stdout
    assert result.stderr.count("Tracing: record_schedule of span Scheduler.schedule raised") == 1
    engine_pid = int(re.search(r"ENGINE (\d+)", result.stdout).group(1))  # type: ignore[union-attr]
    spans = read_spans_jsonl(str(tmp_path / "spans.jsonl"))
    schedules = [s for s in spans if s.name == "Scheduler.schedule"]
    assert len(schedules) >= 6 and all(s.pid == engine_pid for s in schedules)
    for span in schedules:
        assert span.attributes["tracevllm.record_error"] == (
            "RuntimeError: a bug in a record function"
        )
        assert "tracevllm.view.step" not in span.attributes
    steps = [
        s
        for s in spans
        if s.name == "EngineCore.step" and s.attributes.get("tracevllm.request_ids")
    ]
    assert steps and all("tracevllm.record_error" not in s.attributes for s in steps)


def test_trace_file_is_what_otels_file_exporter_writes(tmp_path: Any) -> None:
    """tracevllm's file exporter writes OTel's FileSpanExporter's bytes, on
    spans with every kind of value, link, event, status, parent and limit,
    one span per line and all of them in one batch (grouped by scope)."""
    import math

    from opentelemetry import trace
    from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as otel_encode
    from opentelemetry.exporter.otlp.json.file import FileSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState

    from tracevllm.tracing.exporters import OTLPJsonFileExporter, encode_spans

    ours_path, otel_path = tmp_path / "ours.jsonl", tmp_path / "otel.jsonl"
    provider = TracerProvider(
        resource=Resource.create({"service.name": "t", "process.pid": 7}, "https://r"),
        span_limits=SpanLimits(
            max_span_attributes=32, max_events=2, max_links=3, max_link_attributes=1
        ),
    )
    memory = InMemorySpanExporter()
    for exporter in (OTLPJsonFileExporter(str(ours_path)), FileSpanExporter(otel_path), memory):
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tracevllm")
    other = provider.get_tracer("other", "1.2", schema_url="https://s", attributes={"a": 1})
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("k", "v"), ("z", "1")]))  # fmt: skip
    values = {
        "float": 1.5, "zero": 0.0, "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
        "true": True, "false": False, "int0": 0, "neg": -7, "big": 2**62, "empty": "",
        "text": 'é"\n', "ints": [1, 2], "none": [], "floats": [1.0, 2.5],
        "bools": [True, False], "strs": ["a", ""], "with_none": [None, 1], "bytes": b"\x00\xff",
        "mapping": {"k": 1, "nested": {"x": [1, "y"]}},
        # Lists as the engine sets them: long, signed, escaped.
        "token_ids": [*range(-3, 20), 2**62], "req_ids": ["0", 'é"\n\t\x00🙂', ""],
        "one_int": [5], "one_str": ["x"], "ints_bool": [1, True],
    }  # fmt: skip
    context = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    with tracer.start_as_current_span("root", context, SpanKind.SERVER, values) as root:
        links = [
            Link(remote, {"x": "y", "over": 1}),  # one attribute dropped
            Link(root.get_span_context()),
            # Kept by the SDK for its attributes: written with zero ids.
            Link(trace.INVALID_SPAN_CONTEXT, {"gen_ai.request.id": "0"}),
        ]
        with other.start_as_current_span("child", kind=SpanKind.CLIENT, links=links) as child:
            child.add_event("event", {"n": 1})
            child.add_event("bare")
            child.set_status(trace.StatusCode.OK)
        for kind in (SpanKind.PRODUCER, SpanKind.CONSUMER, SpanKind.INTERNAL):
            tracer.start_span("kind", kind=kind).end()
        # Over the limits: dropped attributes, events and links are counted.
        with tracer.start_as_current_span(
            "dropped", attributes={f"a{i}": i for i in range(40)}, links=links * 2
        ) as span:
            for i in range(4):
                span.add_event(f"e{i}")
        with pytest.raises(ValueError), tracer.start_as_current_span("error"):
            raise ValueError("boom")
        # Values equal as Python keys but written apart.
        for value in (1, True, "1", 1.0, 0.0, -0.0, (1, 2), (True, 2), (1.0, 2), "é" * 300):
            tracer.start_span("same key", attributes={"v": value, "code.line.number": 7}).end()
    provider.shutdown()
    ours, otel = ours_path.read_text(), otel_path.read_text()
    assert ours.count("\n") == 17  # one line per export (SimpleSpanProcessor: per span)
    assert ours == otel
    root_line = next(line for line in ours.splitlines() if '"name":"root"' in line)
    assert all(f'"key":"{key}"' in root_line for key in values)  # none dropped
    spans = memory.get_finished_spans()
    assert {s.name for s in spans} == {"root", "child", "kind", "dropped", "error", "same key"}
    dropped = next(s for s in spans if s.name == "dropped")
    assert (dropped.dropped_attributes, dropped.dropped_events, dropped.dropped_links) == (8, 2, 3)
    # All in one batch: two scopes under one resource, in the order OTel writes.
    line = encode_spans(spans)
    assert line == json.dumps(otel_encode(spans).to_dict(), separators=(",", ":"))
    assert len(json.loads(line)["resourceSpans"][0]["scopeSpans"]) == 2
    assert {s.name for s in read_spans_jsonl(str(ours_path))} == {
        "root", "child", "kind", "dropped", "error", "same key"
    }  # fmt: skip


def test_attribute_values_written_as_text_are_what_json_writes() -> None:
    """The exporter's text path for single values gives the bytes the dict
    path (``_encode_value`` through ``json``) gives, edge values included.
    Mutation caught: a float written with ``str`` of a rounded value, a bool
    taken as an int (``isinstance`` for ``type``)."""
    import enum
    import math

    from tracevllm.tracing.exporters import _dumps, _encode_value, _value_json

    class Color(enum.IntEnum):
        RED = 1

    class Text(str):
        pass

    values = [
        "", "é", "\ud800", "🙂", "\x00\n\t\"\\", Text("sub"), 0, -1, 2**63, 2**64 + 1,
        -(10**30), Color.RED, True, False, 0.0, -0.0, 1e16, 1.5e-7, 1e308, 5e-324, 0.1,
        1 / 3, math.nan, math.inf, -math.inf, None, [1, 2], [], ["a"], [1.5, True],
    ]  # fmt: skip
    for value in values:
        assert _value_json(value) == _dumps(_encode_value(value)), repr(value)


def test_tracing_does_not_change_outputs(tiny_model_dir: str, tmp_path: Any) -> None:
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(
        model=tiny_model_dir,
        enable_multiprocessing=True,
        trace_detail="full",
        trace_dir=str(tmp_path),
    ) as llm:
        traced = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert plain == traced


def test_multiprocess_trace_files(tiny_model_dir: str, tmp_path: Any) -> None:
    with LLM(
        model=tiny_model_dir,
        enable_multiprocessing=True,
        trace_detail="request",
        trace_dir=str(tmp_path),
    ) as llm:
        engine_pid = llm.llm_engine.engine_core.engine_pid
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    # Every line is one OTLP JSON batch.
    with open(tmp_path / "spans.jsonl") as f:
        for line in f:
            assert "resourceSpans" in json.loads(line)
    spans = read_spans_jsonl(str(tmp_path / "spans.jsonl"))
    assert len({s.trace_id for s in spans}) == 1
    pids = {s.pid for s in spans}
    assert pids == {os.getpid(), engine_pid}
    kinds = {s.pid: s.process_kind for s in spans}
    assert kinds[engine_pid] == "engine_core" and kinds[os.getpid()] == "frontend"
    by_id = {s.span_id: s for s in spans}
    add = next(s for s in spans if s.name == "EngineCore.add_request")
    parent = by_id[add.parent_span_id]
    assert parent.pid == os.getpid() and parent.name == "llm_request"
    # The engine flushed on shutdown: its last step is in the file.
    assert any(s.name == "Scheduler.update_from_output" and s.pid == engine_pid for s in spans)

    perfetto = to_perfetto(spans)
    json.loads(json.dumps(perfetto))
    names = {
        e["pid"]: e["args"]["name"] for e in perfetto["traceEvents"] if e["name"] == "process_name"
    }
    assert set(names) == pids
    assert any(n.startswith("engine_core") for n in names.values())
    assert any(n.startswith("frontend") for n in names.values())
    # Slices on one track nest.
    slices = sorted(
        (e for e in perfetto["traceEvents"] if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"])
    )
    open_by_track: dict[tuple[int, int], list[float]] = {}
    for e in slices:
        stack = open_by_track.setdefault((e["pid"], e["tid"]), [])
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1e-3
        stack.append(e["ts"] + e["dur"])


@pytest.mark.slow
def test_make_trace_on_default_model(default_model_dir: str, tmp_path: Any) -> None:
    out = tmp_path / "trace"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracevllm.entrypoints.cli",
            "trace",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "16",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "160"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
    for name in ("spans.jsonl", "trace.perfetto.json", "views.svg", "views.html"):
        assert (out / name).stat().st_size > 0, name
    assert "EngineCore.step" in result.stdout and "⇄" in result.stdout
    assert "<svg" in (out / "views.svg").read_text()[:2000]


ABRUPT = """
import os, signal, sys
from tracevllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], enable_multiprocessing=True, trace_detail="request",
          trace_dir=sys.argv[2])
llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
print(llm.llm_engine.engine_core.engine_pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no shutdown, no atexit, no flush here
"""


def test_engine_flushes_spans_when_frontend_dies(tiny_model_dir: str, tmp_path: Any) -> None:
    import time

    import psutil

    result = subprocess.run(
        [sys.executable, "-c", ABRUPT, tiny_model_dir, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == -9, result.stderr[-2000:]
    engine_pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 20
    while psutil.pid_exists(engine_pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    else:
        if psutil.pid_exists(engine_pid):
            raise AssertionError("the engine process outlived its frontend")
    spans = read_spans_jsonl(str(tmp_path / "spans.jsonl"))
    assert any(s.pid == engine_pid and s.name == "EngineCore.step" for s in spans)


def test_engine_spans_outlast_a_shutdown_cut_short(
    tiny_model_dir: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine process killed half-way through its shutdown still leaves
    its steps' spans: it writes them out on SIGTERM, before stopping its
    workers. Here the worker is stopped (SIGSTOP: it cannot leave), so the
    engine waits on it for seconds (SIGTERM after 4 s, SIGKILL after 8 s),
    past the frontend's patience (cut to 3 s), and gets SIGKILL. OTel's timed
    export is pushed out of the run, so only that first write can save the
    spans."""
    import signal

    from tests.executor_scenarios import worker_pids
    from tracevllm.engine import core_client

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # read by the engine's processes
    monkeypatch.setattr(core_client, "ENGINE_CORE_EXIT_TIMEOUT_S", 3.0)
    llm = LLM(
        model=tiny_model_dir,
        enable_multiprocessing=True,
        distributed_executor_backend="mp",  # the worker in a process of its own
        trace_detail="request",
        trace_dir=str(tmp_path),
    )
    engine_proc = llm.llm_engine.engine_core.resources.proc
    [worker] = worker_pids(engine_proc.pid)
    try:
        [out] = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        os.kill(worker, signal.SIGSTOP)
    finally:
        llm.shutdown()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)  # its parent was killed before it could stop it
    assert engine_proc.exitcode == -signal.SIGKILL  # the shutdown was cut short
    step_names = ("EngineCore.step", "EngineCore.step_with_batch_queue")
    steps = [s for s in read_spans_jsonl(str(tmp_path / "spans.jsonl")) if s.name in step_names]
    assert steps and all(s.pid == engine_proc.pid for s in steps)
    # One step per token: every step the engine ran is there.
    assert len(steps) >= len(out.outputs[0].token_ids)


def test_flush_tracer_keeps_to_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A processor whose flush hangs (an OTLP exporter retrying a dead
    collector; OTel's BatchSpanProcessor does not keep to force_flush's
    timeout) holds a stopping process for timeout_s, not for as long as it
    hangs."""
    import threading
    import time

    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    from tracevllm import tracing

    release = threading.Event()

    class Hanging(SpanProcessor):
        def force_flush(self, timeout_millis: int = 30000) -> bool:
            release.wait(30)  # ignores its timeout, as OTel's batch processor does
            return True

    provider = TracerProvider()
    provider.add_span_processor(Hanging())
    monkeypatch.setattr(tracing._state, "provider", provider)
    t0 = time.monotonic()
    tracing.flush_tracer(timeout_s=0.5)
    waited = time.monotonic() - t0
    release.set()
    assert 0.4 < waited < 5, waited


def test_otlp_endpoint_receives_spans(tiny_model_dir: str) -> None:
    """--otlp-traces-endpoint: a real OTLP/HTTP (JSON) POST to a local collector."""
    from tests.utils import OTLPCollector

    with (
        OTLPCollector() as collector,
        LLM(
            model=tiny_model_dir,
            enable_multiprocessing=True,
            otlp_traces_endpoint=collector.endpoint,
        ) as llm,
    ):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    received = collector.received
    assert received and all(path == "/v1/traces" for path, _ in received)
    names, kinds = set(), set()
    for _, body in received:
        for rs in body["resourceSpans"]:
            for attr in rs["resource"]["attributes"]:
                if attr["key"] == "tracevllm.process_kind":
                    kinds.add(attr["value"]["stringValue"])
            for ss in rs["scopeSpans"]:
                names.update(s["name"] for s in ss["spans"])
    assert {"llm_request", "EngineCore.step"} <= names
    assert kinds == {"frontend", "engine_core"}


def test_span_ids_differ_in_a_forked_child() -> None:
    """A child forked with the parent's id generator must not mint the
    parent's next ids (the generator is seeded again after a fork)."""
    from tracevllm import tracing

    generator = tracing._IdGenerator()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send one id, leave at once
        os.write(write, generator.generate_span_id().to_bytes(8, "big"))
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = int.from_bytes(os.read(read, 8), "big")
    os.close(read)
    assert child != generator.generate_span_id()


def test_span_ids_do_not_follow_the_engine_seed() -> None:
    """The engine seeds Python's random (for sampling); span ids must not
    repeat because of it, or two processes would mint the same ids."""
    import random

    from tracevllm import tracing
    from tracevllm.config import TraceConfig

    ids = []
    try:
        for _ in range(2):
            random.seed(0)
            tracing.init_tracer("frontend", TraceConfig(detail="request"))
            with tracing.get_tracer().start_as_current_span("x") as span:
                ids.append((span.get_span_context().trace_id, span.get_span_context().span_id))
    finally:
        tracing.shutdown_tracer()
    assert ids[0][0] != ids[1][0] and ids[0][1] != ids[1][1]


def test_trace_headers_are_parsed_once_and_read_as_otel_reads_them() -> None:
    """A request's trace headers give the context OTel's propagator reads
    from them (tracestate included, a malformed traceparent ignored), and
    are parsed once however many steps read them."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from tracevllm import tracing

    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    carriers: list[dict[str, str]] = [
        {"traceparent": traceparent},
        {"traceparent": traceparent, "tracestate": "k=v"},
        {"traceparent": traceparent, "tracestate": "k=w"},
        {"traceparent": traceparent.replace("-01", "-00")},
        {"traceparent": "not a traceparent"},
        {"tracestate": "k=v"},
    ]
    not_kept: list[dict[str, Any]] = [  # parsed each time, as before
        {"traceparent": traceparent + "-" + "0" * 1000},  # too long: OTel ignores it
        {"traceparent": traceparent, "tracestate": "k=v," * 200},  # over 512 characters
        {"traceparent": [traceparent]},  # a list, as OTel's getter takes
    ]
    assert tracing.extract_trace_context({}) is None
    tracing._extract.cache_clear()
    for carrier in carriers + not_kept:
        ours = trace.get_current_span(tracing.extract_trace_context(carrier)).get_span_context()
        otel = TraceContextTextMapPropagator().extract(carrier)
        assert ours == trace.get_current_span(otel).get_span_context()
        assert ours.trace_state == trace.get_current_span(otel).get_span_context().trace_state
    parsed = tracing._extract.cache_info().misses
    for _ in range(3):  # later steps: no parse
        for carrier in carriers + not_kept:
            tracing.extract_trace_context(carrier)
    assert tracing._extract.cache_info().misses == parsed == len(carriers) - 1
    assert tracing._extract.cache_info().currsize == len(carriers) - 1


def test_tracing_cost_bench_counts_only_tracing_code(tmp_path: Any) -> None:
    """benchmarks/bench_tracing_cost.py's reading of py-spy's samples: a
    sample is tracing's from the first frame of tracing code in, with all it
    calls, until that hands back to the engine (the method a span wraps, or a
    kernel); each is put on the thread it was taken on."""
    import tracevllm

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import bench_tracing_cost as bench
    finally:
        sys.path.pop(0)
    package = os.path.dirname(os.path.abspath(tracevllm.__file__)) + os.sep
    otel = bench._tracing_dirs()[1]
    torch_frame = "Module._call_impl (/venv/torch/nn/modules/module.py:1)"
    wrapper = f"{bench.WRAPPERS[0]}({package}tracing/__init__.py:225)"
    loop = f"EngineCoreProc.run_busy_loop ({package}engine/core.py:300)"
    # The engine core's command line holds a ';', which py-spy's format does not escape.
    engine = ['process 1:"python bench"', 'process 2:"python -c import spawn_main',
              ' spawn_main(fd=18)"', "thread (2): MainThread", loop, wrapper,
              f"EngineCore.step ({package}engine/core.py:190)"]  # fmt: skip
    attention = f"Attention._forward_traced ({package}model_executor/layers/attention.py:80)"
    record = f"record_schedule ({package}tracing/step_view.py:40)"
    start_span = f"Tracer.start_span ({otel}sdk/trace/__init__.py:1200)"
    contextlib_exit = "_GeneratorContextManager.__exit__ (/usr/lib/contextlib.py:1)"
    _attention, _wrapper = "Attention._forward_traced", bench.WRAPPERS[0].strip()
    read_frame = "maybe_transfer_kv_layer.<locals>.wrapper "
    assert read_frame in bench._kernel_frames()
    stacks = {
        # The engine's method inside instrument's wrapper, in torch: the engine's.
        (*engine, torch_frame): ("engine core", None),
        (*engine, "Span.__init__ (/x/y.py:1)"): ("engine core", None),  # not OTel's file
        # Making the span, its record, what the record calls: tracing's.
        (*engine, start_span): ("engine core", "Tracer.start_span"),
        (*engine, wrapper, contextlib_exit, start_span): ("engine core", "Tracer.start_span"),
        (*engine, record, f"BlockPool.get_num_free_blocks ({package}core/block_pool.py:9)"): (
            "engine core",
            "record_schedule",
        ),
        (*engine, attention): ("engine core", _attention),  # the attention spans' .tolist()s
        (*engine, attention, f"get_attention_context ({package}x.py:1)"): (
            "engine core",
            _attention,
        ),
        # Handed back: the wrapped method's own decorator, the span's with is not;
        # a kernel inside the attention spans.
        (*engine, wrapper, "decorate_context (/venv/torch/utils/_contextlib.py:1)"): (
            "engine core",
            None,
        ),
        (*engine, wrapper, contextlib_exit): ("engine core", _wrapper),
        (*engine, attention, f"unified_kv_cache_update ({package}x.py:9)", torch_frame): (
            "engine core",
            None,
        ),
        # The read runs inside the KV connector's wrapper, which py-spy names.
        (*engine, attention, f"{read_frame}({package}x.py:9)", torch_frame): ("engine core", None),
        (
            'process 1:"python bench"',
            "thread (1): MainThread",
            f"LLM.generate ({package}entrypoints/llm.py:90)",
        ): ("frontend", None),  # fmt: skip
        (
            'process 1:"python bench"',
            "thread (3): OtelBatchSpanRecordProcessor",
            "Thread.run (/usr/lib/threading.py:1)",
            f"BatchProcessor.worker ({otel}sdk/_shared_internal/__init__.py:1)",
            "JSONEncoder.iterencode (/usr/lib/json/encoder.py:1)",
        ): ("exporter", "BatchProcessor.worker"),  # fmt: skip
        (
            'process 1:"python bench"',
            'process 2:"python -c spawn_main"',
            "thread (4): EngineCoreOutputThread",
            "run (/usr/lib/threading.py:1)",
        ): ("other", None),  # fmt: skip
    }
    raw = tmp_path / "samples.txt"
    raw.write_text("".join(f"{';'.join(stack)} {i + 1}\n" for i, stack in enumerate(stacks)))
    count = bench.Count()
    bench.read_samples(str(raw), count)
    samples: Counter[str] = Counter()
    tracing: Counter[str] = Counter()
    where: Counter[str] = Counter()  # the innermost frame of tracing code
    for i, (kind, innermost) in enumerate(stacks.values()):
        samples[kind] += i + 1
        if innermost is not None:
            tracing[kind] += i + 1
            where[innermost] += i + 1
    assert count.samples == samples
    assert count.tracing == tracing
    assert count.where == where
