"""What a span costs to write to ``spans.jsonl``: OTel's encoder against tracevllm's.

``--detail full`` (the default) builds the spans one decode step adds at
``full`` on the default model (30 layers, each a ``LlamaDecoderLayer.forward``
span around its KV write and read, layer 0 with the step's arrays for a batch
of 64), with the same attributes the engine puts on them, and times, per span
and best of ``--repeats``:

- **made**: ``start_as_current_span`` with those attributes, nested as in the
  engine (what the engine's own thread pays);
- **written**: encoding a step's spans as one OTLP JSON line, by OTel's
  ``FileSpanExporter`` encoder and by tracevllm's ``OTLPJsonFileExporter``
  (what the exporter's thread pays), and checks the two lines are equal.

``--detail request`` (tracing's default detail) runs ``make bench``'s
workload (``--num-prompts`` chat prompts, one generate) with the engine in
this process and one compute thread, keeps every span, and encodes them in
the exporter's batches (512) with each encoder, best of ``--repeats``. It
prints each encoder's CPU against the generate's own: the thread time of the
one thread that ran it (the scheduler, the model and the output processing),
so time spent waiting for a busy machine is not counted.

    python benchmarks/bench_span_export.py [--steps 20] [--repeats 5]
    python benchmarks/bench_span_export.py --detail request [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NUM_LAYERS, BATCH, BLOCK_SIZE = 30, 64, 16


def make_step(tracer: Any, layer_code: dict, write_code: dict, read_code: dict) -> None:
    """One decode step's ``full`` spans, attributes as Attention._forward_traced sets them."""
    slots = list(range(1000, 1000 + BATCH))
    seq_lens = [33] * BATCH
    starts = list(range(BATCH + 1))
    for i in range(NUM_LAYERS):
        layer = {"tracevllm.layer": i, "tracevllm.layer_name": f"model.layers.{i}.self_attn.attn"}
        write = {**write_code, **layer, "tracevllm.kv_cache_shape": [1456, 2, BLOCK_SIZE, 3, 64]}
        read = {
            **read_code,
            **layer,
            "tracevllm.block_table_shape": [BATCH, 3],
            "tracevllm.backend": "TORCH_ATTN",
            "tracevllm.attention.launch": "unified_attention_torch (SDPA)",
        }
        if i == 0:
            write["tracevllm.slot_mapping"] = slots
            read["tracevllm.query_start_loc"] = starts
            read["tracevllm.seq_lens"] = seq_lens
        with tracer.start_as_current_span(
            "LlamaDecoderLayer.forward", attributes={**layer_code, "tracevllm.layer": i}
        ):
            with tracer.start_as_current_span("reshape_and_cache_flash", attributes=write):
                pass
            with tracer.start_as_current_span("unified_attention", attributes=read):
                pass


def otel_line(spans: Any) -> str:
    """The line OTel's ``FileSpanExporter`` writes (without its newline)."""
    from opentelemetry.exporter.otlp.json.file.trace_exporter import _encode_spans_to_dict

    return json.dumps(_encode_spans_to_dict(spans), separators=(",", ":"))


def bench_request(num_prompts: int, repeats: int) -> None:
    """Every span of a ``request``-detail generate, written by each encoder."""
    # Before the engine starts: one compute thread, so that the generate's
    # work is all in this thread's CPU time.
    os.environ["TRACEVLLM_NUM_THREADS"] = "1"
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from transformers import AutoTokenizer

    from tracevllm import LLM
    from tracevllm.benchmarks.datasets import chat_samples
    from tracevllm.benchmarks.throughput import run_tracevllm
    from tracevllm.model_executor.model_loader import resolve_model
    from tracevllm.tracing.exporters import encode_spans

    samples = chat_samples(AutoTokenizer.from_pretrained(resolve_model(None)), num_prompts)
    memory = InMemorySpanExporter()
    with LLM(enable_multiprocessing=False, trace_detail="request") as llm:
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(memory))
        run_tracevllm(llm, samples[:2], num_warmups=0, use_tqdm=False)  # warm-up
        memory.clear()
        cpu = time.thread_time()
        wall, outputs = run_tracevllm(llm, samples, num_warmups=0, use_tqdm=False)
        cpu = time.thread_time() - cpu
    spans = memory.get_finished_spans()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # As BatchSpanProcessor hands them to the exporter (its default batch).
    batches = [spans[i : i + 512] for i in range(0, len(spans), 512)]
    encoders = {"OTel FileSpanExporter": otel_line, "tracevllm OTLPJsonFileExporter": encode_spans}
    assert all(otel_line(b) == encode_spans(b) for b in batches), "the lines differ"
    written = dict.fromkeys(encoders, float("inf"))
    for _ in range(repeats):  # the two in turn, so both see the same machine
        for name, encode in encoders.items():
            start = time.thread_time()
            for batch in batches:
                encode(batch)
            written[name] = min(written[name], time.thread_time() - start)
    load = os.getloadavg()[0]
    print(f"# --detail request: {num_prompts} chat prompts, {tokens} tokens, {len(spans)} spans\n"
          f"# the generate: {cpu:.2f} s of CPU ({wall:.2f} s wall), load {load:.2f}")  # fmt: skip
    for name, seconds in written.items():
        print(f"written ({name}): {seconds:.3f} s = {seconds / len(spans) * 1e6:6.1f} us/span, "
              f"{seconds / cpu * 100:.2f}% of the generate's CPU")  # fmt: skip
    ours, otel = written["tracevllm OTLPJsonFileExporter"], written["OTel FileSpanExporter"]
    print(f"tracevllm's encoder saves {otel - ours:.3f} s: {(otel - ours) / cpu * 100:.2f}% "
          f"of the generate's CPU (the same lines, checked)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--detail", choices=("full", "request"), default="full")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=64)
    args = parser.parse_args()
    for flag in ("steps", "repeats", "num_prompts"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.detail == "request":
        bench_request(args.num_prompts, args.repeats)
        return

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracevllm import tracing
    from tracevllm.model_executor.layers import attention
    from tracevllm.model_executor.models import llama
    from tracevllm.tracing.exporters import encode_spans

    codes = (llama._LAYER_CODE, attention._WRITE_CODE, attention._READ_CODE)
    memory = InMemorySpanExporter()
    provider = TracerProvider(id_generator=tracing._IdGenerator())
    tracer = provider.get_tracer("tracevllm")
    bare = TracerProvider(id_generator=tracing._IdGenerator()).get_tracer("t")
    spans_per_step = 3 * NUM_LAYERS

    made = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            make_step(bare, *codes)
        made.append((time.perf_counter() - start) / (args.steps * spans_per_step))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    make_step(tracer, *codes)
    step_spans = memory.get_finished_spans()
    assert len(step_spans) == spans_per_step

    lines = {
        "OTel FileSpanExporter": lambda: otel_line(step_spans),
        "tracevllm OTLPJsonFileExporter": lambda: encode_spans(step_spans),
    }
    assert len({line() for line in lines.values()}) == 1, "the lines differ"
    written = dict.fromkeys(lines, float("inf"))
    for _ in range(args.repeats):  # the two in turn, so both see the same machine
        for name, line in lines.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                line()
            seconds = (time.perf_counter() - start) / (args.steps * spans_per_step)
            written[name] = min(written[name], seconds)
    load = os.getloadavg()[0]
    print(f"# {spans_per_step} spans per decode step at --detail full (batch {BATCH}), "
          f"best of {args.repeats} x {args.steps} steps, load {load:.2f}")  # fmt: skip
    print(f"made (start_as_current_span, engine thread): {min(made) * 1e6:6.1f} us/span")
    for name, seconds in written.items():
        print(f"written ({name}): {seconds * 1e6:6.1f} us/span")
    ours, otel = written["tracevllm OTLPJsonFileExporter"], written["OTel FileSpanExporter"]
    print(f"OTel's encoder / tracevllm's: {otel / ours:.2f}x (the same line, checked)")


if __name__ == "__main__":
    main()
