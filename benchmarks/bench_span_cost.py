"""What the spans inside the model's forward cost in a real generate, made in place or timed.

Runs 16 chat prompts (greedy, at most ``--max-tokens`` each) through the
default model in one process at ``--detail full``, alternating two ways of
making the spans inside ``LlamaModel.forward`` (each layer's
``LlamaDecoderLayer.forward``, KV write and read; 90 a step), the first
one rotating round by round:

- **in place**: ``tracing.forward_spans`` switched off, so each is an OTel
  span made between two kernels (how tracevllm made them before);
- **timed**: as the engine runs, each only timed and the OTel spans made
  when the forward ends (``tracing.forward_spans``).

It times the spans' own code in the engine's thread (made, entered and
left, plus the making at the forward's end) and prints, as medians, the
microseconds a span costs, the seconds a generate spends on them and the
generate's wall time. Then it makes the same spans again in a loop, one
after another with nothing between them: what a span costs with the caches
warm. The last column is the CPU spent in the file exporter's ``export``
on the generate's spans, all of them (the request's and steps' too), on
whichever thread ran it (the batch processor's, or this one for what is
left at the flush after the generate). The timer around each call adds
about a microsecond to every row.

    python benchmarks/bench_span_cost.py [--rounds 3] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from tracevllm import LLM, tracing
from tracevllm.benchmarks.datasets import chat_samples
from tracevllm.benchmarks.throughput import run_tracevllm
from tracevllm.tracing.exporters import OTLPJsonFileExporter


class _Clock:
    """Nanoseconds spent in the spans' own code, how many spans, and which."""

    def __init__(self) -> None:
        self.ns = 0
        self.spans = 0
        self.seen: list[tuple[str, Any]] = []
        self.export_ns = 0  # CPU in the file exporter's export(), every span


def _timed_calls(clock: _Clock) -> Any:
    """Wrap tracing.span (as llama.py and attention.py call it) and
    _ForwardSpans.end so that the time in them goes on ``clock``, and the
    file exporter's export so that the CPU in it does; returns a function
    that puts them back."""
    span, end, export = tracing.span, tracing._ForwardSpans.end, OTLPJsonFileExporter.export

    class Timed:
        def __init__(self, block: Any) -> None:
            self.block = block

        def __enter__(self) -> Any:
            t = time.perf_counter_ns()
            try:
                return self.block.__enter__()
            finally:
                clock.ns += time.perf_counter_ns() - t

        def __exit__(self, *exc: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return self.block.__exit__(*exc)
            finally:
                clock.ns += time.perf_counter_ns() - t

    def timed_span(name: str, attributes: Any) -> Timed:
        t = time.perf_counter_ns()
        block = Timed(span(name, attributes))
        clock.ns += time.perf_counter_ns() - t
        clock.spans += 1
        clock.seen.append((name, attributes))
        return block

    def timed_end(self: Any, tracer: Any) -> None:
        t = time.perf_counter_ns()
        end(self, tracer)
        clock.ns += time.perf_counter_ns() - t

    def timed_export(self: Any, spans: Any) -> Any:
        t = time.thread_time_ns()
        try:
            return export(self, spans)
        finally:
            clock.export_ns += time.thread_time_ns() - t

    tracing.span = timed_span  # type: ignore[assignment]
    tracing._ForwardSpans.end = timed_end  # type: ignore[method-assign]
    OTLPJsonFileExporter.export = timed_export  # type: ignore[method-assign]

    def restore() -> None:
        tracing.span = span
        tracing._ForwardSpans.end = end  # type: ignore[method-assign]
        OTLPJsonFileExporter.export = export  # type: ignore[method-assign]

    return restore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    console = Console()

    forward_spans = tracing.forward_spans
    ways = {"in place": contextlib.nullcontext, "timed": forward_spans}
    clock = _Clock()
    restore = _timed_calls(clock)
    results: dict[str, list[tuple[float, float, float, int, float]]] = {way: [] for way in ways}
    try:
        with (
            tempfile.TemporaryDirectory() as d,
            LLM(enable_multiprocessing=False, trace_detail="full", trace_dir=d) as llm,
        ):
            samples = [
                dataclasses.replace(
                    s, expected_output_len=min(s.expected_output_len, args.max_tokens)
                )
                for s in chat_samples(llm.get_tokenizer(), 16, seed=1)
            ]
            run_tracevllm(llm, samples[:2], num_warmups=0, use_tqdm=False)  # warm-up
            order = list(ways)
            for round_ in range(args.rounds):
                for way in order[round_ % 2 :] + order[: round_ % 2]:
                    tracing.forward_spans = ways[way]  # type: ignore[assignment]
                    provider = tracing.get_provider()
                    if provider is None:
                        raise SystemExit("tracing is off: no span to time")
                    provider.force_flush()
                    clock.ns = clock.spans = clock.export_ns = 0
                    clock.seen.clear()
                    wall, _ = run_tracevllm(llm, samples, num_warmups=0, use_tqdm=False)
                    provider.force_flush()
                    exported = clock.export_ns / 1e9
                    if clock.spans == 0:
                        raise SystemExit("no span was made in the forward: is tracing on?")
                    per_span = clock.ns / clock.spans / 1e3
                    results[way].append((per_span, clock.ns / 1e9, wall, clock.spans, exported))
                    console.print(
                        f"round {round_ + 1}, {way}: {clock.spans} spans in forwards, "
                        f"{per_span:.1f} µs a span, {clock.ns / 1e9:.2f} s of the "
                        f"generate's {wall:.2f} s; the exporter {exported:.2f} s of CPU"
                    )
            # The same spans again, one after another, nothing between them.
            tracing.forward_spans = contextlib.nullcontext  # type: ignore[assignment]
            spans = clock.seen[: 3 * 90]
            clock.ns = clock.spans = 0
            for _ in range(4):  # within the exporter's queue (2048)
                for name, attributes in spans:
                    with tracing.span(name, attributes):
                        pass
            loop = clock.ns / clock.spans / 1e3
    finally:
        tracing.forward_spans = forward_spans
        restore()
    table = Table(title=f"Spans inside the forward, {args.rounds} rounds (medians)")
    columns = ("made", "spans a generate", "µs a span", "s a generate", "generate s", "exporter s")
    for col in columns:
        table.add_column(col, justify="left" if col == "made" else "right")
    for way, runs in results.items():
        table.add_row(
            way,
            str(runs[0][3]),
            f"{statistics.median(r[0] for r in runs):.1f}",
            f"{statistics.median(r[1] for r in runs):.2f}",
            f"{statistics.median(r[2] for r in runs):.2f}",
            f"{statistics.median(r[4] for r in runs):.2f}",
        )
    table.add_row("in a loop", "", f"{loop:.1f}", "", "", "")
    console.print(table)


if __name__ == "__main__":
    main()
