"""What one span costs at ``--detail full``: made, and written to ``spans.jsonl``.

Builds the spans one decode step adds at ``full`` on the default model (30
layers, each a ``LlamaDecoderLayer.forward`` span around its KV write and
read, layer 0 with the step's arrays for a batch of 64), with the same
attributes the engine puts on them, and times, per span and best of
``--repeats``:

- **made**: ``start_as_current_span`` with those attributes, nested as in the
  engine (what the engine's own thread pays);
- **written**: encoding a step's spans as one OTLP JSON line, by OTel's
  ``FileSpanExporter`` encoder and by tracevllm's ``OTLPJsonFileExporter``
  (what the exporter's thread pays), and checks the two lines are equal.

    python benchmarks/bench_span_export.py [--steps 20] [--repeats 5]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from opentelemetry.exporter.otlp.json.file.trace_exporter import _encode_spans_to_dict
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
        "OTel FileSpanExporter": lambda: json.dumps(
            _encode_spans_to_dict(step_spans), separators=(",", ":")
        ),
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
