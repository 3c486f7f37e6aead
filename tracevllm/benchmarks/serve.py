"""``tracevllm bench serve``: load an OpenAI-compatible server and measure it.

Mirrors vllm/benchmarks/serve.py (``benchmark``, ``calculate_metrics``, its
printed table and its JSON result keys: ``request_throughput``,
``output_throughput``, ``mean_ttft_ms``, ``p99_itl_ms`` ...) and the streaming
request of vllm/benchmarks/lib/endpoint_request_func.py. Any server that
speaks the API works, so the same client measures ``tracevllm serve`` and
``vllm serve`` alike. The prompts are the ``make bench`` chat prompts (vLLM
also offers random, ShareGPT and other datasets). Each request streams
``/v1/chat/completions`` with ``ignore_eos``, so every one generates exactly
``--output-len`` tokens.

Metrics, per request: TTFT (send to first content), ITL (between chunks),
TPOT ((latency - TTFT) / (tokens - 1)), E2EL (send to last chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from tracevllm.benchmarks.datasets import chat_prompts


@dataclass
class RequestFuncOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def async_request_openai_chat_completions(
    client: Any, url: str, model: str, prompt: str, output_len: int, api_key: str | None
) -> RequestFuncOutput:
    """One streamed chat request; the times of its chunks."""
    out = RequestFuncOutput()
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                out.error = (await response.aread()).decode()
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if usage := chunk.get("usage"):
                    out.prompt_len = usage["prompt_tokens"]
                    out.output_tokens = usage["completion_tokens"]
                if not any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
                    continue
                now = time.perf_counter()
                if not out.ttft:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
        out.latency = last - start
        out.success = out.output_tokens > 0
    except Exception as e:  # a failed request counts as failed, the run goes on
        out.error = f"{type(e).__name__}: {e}"
    return out


def calculate_metrics(
    outputs: list[RequestFuncOutput], duration: float, percentiles: list[float]
) -> dict[str, Any]:
    done = [o for o in outputs if o.success]
    total_output = sum(o.output_tokens for o in done)
    total_input = sum(o.prompt_len for o in done)
    series = {
        "ttft": [o.ttft for o in done],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1],
        "itl": [t for o in done for t in o.itl],
        "e2el": [o.latency for o in done],
    }
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "errors": [o.error for o in outputs if o.error],
    }
    for name, values in series.items():
        ms = [v * 1000 for v in values] or [0.0]
        result[f"mean_{name}_ms"] = statistics.fmean(ms)
        result[f"median_{name}_ms"] = statistics.median(ms)
        result[f"std_{name}_ms"] = statistics.pstdev(ms)
        for p in percentiles:
            result[f"p{p:g}_{name}_ms"] = _percentile(ms, p)
    return result


def _percentile(values: list[float], p: float) -> float:
    """numpy's default (linear) percentile, without numpy."""
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    url = f"{args.base_url or f'http://{args.host}:{args.port}'}/v1/chat/completions"
    concurrency = args.max_concurrency or args.num_prompts
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:

        async def one(prompt: str) -> RequestFuncOutput:
            async with semaphore:
                return await async_request_openai_chat_completions(
                    client, url, args.model, prompt, args.output_len, args.api_key
                )

        # --request-rate: Poisson arrivals, as vLLM's (seeded); inf: all at once.
        rng = random.Random(0)
        arrivals, t = [], 0.0
        for _ in range(args.num_prompts):
            arrivals.append(t)
            if args.request_rate != float("inf"):
                t += rng.expovariate(args.request_rate)

        async def paced(arrival: float, prompt: str) -> RequestFuncOutput:
            await asyncio.sleep(arrival)
            return await one(prompt)

        start = time.perf_counter()
        outputs = await asyncio.gather(
            *(paced(a, p) for a, p in zip(arrivals, chat_prompts(args.num_prompts)))
        )
        duration = time.perf_counter() - start
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    result = calculate_metrics(outputs, duration, percentiles)
    result |= {
        "max_concurrency": concurrency,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "model_id": args.model,
        "base_url": url,
    }
    return result


def print_result(result: dict[str, Any], percentiles: str) -> None:
    """vLLM's table."""
    rows = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Maximum request concurrency:", result["max_concurrency"]),
        ("Benchmark duration (s):", f"{result['duration']:.2f}"),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for label, value in rows:
        print(f"{label:<40} {value:<10}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token "
                        "(excl. 1st token)"), ("itl", "Inter-token Latency"),
                        ("e2el", "End-to-end Latency")):  # fmt: skip
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        short = name.upper()
        print(f"{f'Mean {short} (ms):':<40} {result[f'mean_{name}_ms']:<10.2f}")
        print(f"{f'Median {short} (ms):':<40} {result[f'median_{name}_ms']:<10.2f}")
        for p in percentiles.split(","):
            key = f"p{float(p):g}_{name}_ms"
            print(f"{f'P{float(p):g} {short} (ms):':<40} {result[key]:<10.2f}")
    print("=" * 50)
    if result["errors"]:
        print(f"First error: {result['errors'][0]}")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--output-len", type=int, default=64, help="tokens per request")
    parser.add_argument("--metric-percentiles", default="50,90,99")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--label", default="tracevllm", help="name in the result file")


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(benchmark(args))
    result["label"] = args.label
    print_result(result, args.metric_percentiles)
    if args.save_result:
        name = args.result_filename or f"bench-serve-{args.label}.json"
        path = os.path.join(args.result_dir, name)
        os.makedirs(args.result_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")
    return 0 if result["completed"] else 1
