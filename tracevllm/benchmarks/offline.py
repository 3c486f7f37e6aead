"""What ``bench latency`` and ``bench sweep`` share: run requests through an
``LLM`` and time every token as it comes back.

vLLM's offline benchmarks time only whole ``LLM.generate`` calls; the per-token
times (TTFT, ITL) come from its serving benchmark. Here the same measures are
taken offline: the requests are added to the ``LLMEngine`` with
``RequestOutputKind.DELTA`` and the engine is stepped by hand (as
``LLM._run_engine`` does), noting when each request's tokens arrive. The
records are ``bench serve``'s ``RequestFuncOutput`` and its
``calculate_metrics`` turns them into vLLM's metric names.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tracevllm.benchmarks.datasets import SampleRequest
from tracevllm.benchmarks.serve import RequestFuncOutput


@dataclass
class TimedRun:
    outputs: list[RequestFuncOutput]
    # Wall time from the first request sent to the last token received.
    duration: float
    # Seconds between consecutive engine steps that returned tokens (the
    # first: from the start to the first tokens).
    step_latencies: list[float] = field(default_factory=list)


def make_llm(args: argparse.Namespace, **overrides: Any) -> Any:
    """An ``LLM`` from the command's engine flags (``EngineArgs``'s)."""
    from tracevllm.engine.arg_utils import EngineArgs
    from tracevllm.entrypoints.llm import LLM

    return LLM(**(vars(EngineArgs.from_cli_args(args)) | overrides))


def run_timed(
    llm: Any,
    samples: list[SampleRequest],
    temperature: float = 0.0,
    detokenize: bool = True,
    request_rate: float = float("inf"),
    description: str = "requests",
    show_progress: bool = True,
) -> TimedRun:
    """Every sample to its ``expected_output_len`` (``ignore_eos``), arriving
    all at once or, with a finite ``request_rate``, as a seeded Poisson stream."""
    from tracevllm.sampling_params import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    rng = random.Random(0)
    arrivals, t = [], 0.0
    for _ in samples:
        arrivals.append(t)
        if request_rate != float("inf"):
            t += rng.expovariate(request_rate)
    outputs = [RequestFuncOutput(prompt_len=s.prompt_len) for s in samples]
    sent: dict[str, tuple[int, float]] = {}  # request id -> (index, send time)
    last: dict[int, float] = {}
    steps: list[float] = []
    progress = Progress(
        TextColumn(description), BarColumn(), MofNCompleteColumn(),
        TextColumn("[cyan]{task.fields[tokens]} tokens"), TimeElapsedColumn(),
        disable=not show_progress,
    )  # fmt: skip
    added: list[str] = []
    with progress:
        task = progress.add_task(description, total=len(samples), tokens=0)
        start = last_step = time.perf_counter()
        num_tokens = next_i = 0
        try:
            while next_i < len(samples) or engine.has_unfinished_requests():
                now = time.perf_counter()
                while next_i < len(samples) and arrivals[next_i] <= now - start:
                    sample = samples[next_i]
                    params = SamplingParams(
                        temperature=temperature,
                        max_tokens=sample.expected_output_len,
                        ignore_eos=True,
                        detokenize=detokenize,
                        output_kind=RequestOutputKind.DELTA,
                    )
                    rid = str(next(llm.request_counter))
                    sent[rid] = (next_i, time.perf_counter())
                    added.append(engine.add_request(
                        rid, {"prompt_token_ids": sample.prompt_token_ids}, params
                    ))  # fmt: skip
                    next_i += 1
                if not engine.has_unfinished_requests():
                    time.sleep(max(0.0, arrivals[next_i] - (time.perf_counter() - start)))
                    continue
                step_outputs = engine.step()
                now = time.perf_counter()
                if any(o.outputs[0].token_ids for o in step_outputs):
                    steps.append(now - last_step)
                    last_step = now
                for o in step_outputs:
                    i, sent_at = sent[o.request_id]
                    out, new = outputs[i], len(o.outputs[0].token_ids)
                    if new:
                        if not out.ttft:
                            out.ttft = now - sent_at
                        else:
                            out.itl.append(now - last[i])
                        last[i] = now
                        out.output_tokens += new
                        num_tokens += new
                    if o.finished:
                        out.latency = now - sent_at
                        out.success = out.output_tokens > 0
                        progress.update(task, advance=1, tokens=num_tokens)
        except BaseException:
            # Interrupted: withdraw what is still running, as LLM.generate does.
            if not engine.is_shut_down:
                engine.abort_request(added, internal=True)
            raise
        duration = time.perf_counter() - start
    return TimedRun(outputs, duration, steps)


def write_json(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=4)
    print(f"wrote {path}")
