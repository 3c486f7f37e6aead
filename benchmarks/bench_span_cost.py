"""What the spans inside the model's forward cost in a real generate, made in place or timed.

Runs 16 chat prompts (greedy, at most ``--max-tokens`` each) through the
default model in one process at ``--detail full``, alternating two ways of
making the spans inside ``LlamaModel.forward`` (each layer's
``LlamaDecoderLayer.forward``, KV write and read; 90 a step):

- **in place**: ``tracing.forward_spans`` switched off, so each is an OTel
  span made between two kernels (how tracevllm made them before);
- **timed**: as the engine runs, each only timed and the OTel spans made
  when the forward ends (``tracing.forward_spans``).

It times the spans' own code (made, entered and left, plus the making at
the forward's end) and prints, per round and as medians, the microseconds a
span costs and the seconds a generate spends on them. A span made in a loop
costs what ``benchmarks/bench_span_export.py`` prints: the difference is the
caches the kernels between two spans have emptied. The timer around each
call adds about a microsecond to both.

    python benchmarks/bench_span_cost.py [--rounds 3] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from tracevllm import LLM, SamplingParams, tracing
from tracevllm.benchmarks.datasets import chat_samples


class _Clock:
    """Nanoseconds spent in the spans' own code, and how many spans."""

    def __init__(self) -> None:
        self.ns = 0
        self.spans = 0


def _timed_calls(clock: _Clock) -> None:
    """Wrap tracing.span (as llama.py and attention.py call it) and
    _ForwardSpans.end so that the time in them goes on ``clock``."""
    span, end = tracing.span, tracing._ForwardSpans.end

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
        return block

    def timed_end(self: Any, tracer: Any) -> None:
        t = time.perf_counter_ns()
        end(self, tracer)
        clock.ns += time.perf_counter_ns() - t

    tracing.span = timed_span  # type: ignore[assignment]
    tracing._ForwardSpans.end = timed_end  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    console = Console()

    forward_spans = tracing.forward_spans
    ways = {"in place": contextlib.nullcontext, "timed": forward_spans}
    clock = _Clock()
    _timed_calls(clock)
    with (
        tempfile.TemporaryDirectory() as d,
        LLM(enable_multiprocessing=False, trace_detail="full", trace_dir=d) as llm,
    ):
        samples = chat_samples(llm.get_tokenizer(), 16, seed=1)
        prompts = [{"prompt_token_ids": s.prompt_token_ids} for s in samples]
        params = [
            SamplingParams(
                temperature=0.0, max_tokens=min(s.expected_output_len, args.max_tokens),
                ignore_eos=True,
            )
            for s in samples
        ]  # fmt: skip
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        results: dict[str, list[tuple[float, float, int]]] = {way: [] for way in ways}
        for round_ in range(args.rounds):
            for way, scope in ways.items():
                tracing.forward_spans = scope  # type: ignore[assignment]
                clock.ns = clock.spans = 0
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - start
                results[way].append((clock.ns / clock.spans / 1e3, clock.ns / 1e9, clock.spans))
                console.print(
                    f"round {round_ + 1}, {way}: {clock.spans} spans in forwards, "
                    f"{clock.ns / clock.spans / 1e3:.1f} µs a span, "
                    f"{clock.ns / 1e9:.2f} s of the generate's {wall:.2f} s"
                )
        tracing.forward_spans = forward_spans
    table = Table(title=f"Spans inside the forward, {args.rounds} rounds (medians)")
    for col in ("made", "spans a generate", "µs a span", "s a generate"):
        table.add_column(col, justify="left" if col == "made" else "right")
    for way, runs in results.items():
        table.add_row(
            way,
            str(runs[0][2]),
            f"{statistics.median(r[0] for r in runs):.1f}",
            f"{statistics.median(r[1] for r in runs):.2f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
