"""Record the serving chapter's load figures: ``make bench-serve``'s run of
``tracevllm bench serve`` against ``tracevllm serve``, as facts the chapter
quotes.

tracevllm's own (the client is ``tracevllm bench serve``'s, vLLM's ``vllm bench
serve`` counterpart in tracevllm/benchmarks/serve.py, with make bench-serve's
workload). ``python docs/record_serve_bench.py`` starts the
server on the default model, warms it up, runs one stream of 64 tokens alone,
then 32 concurrent streams of 64 tokens, and writes
``docs/assets/recorded/facts.bench_serve.json``: for each, the throughput and
the TTFT, ITL and end-to-end percentiles, with the machine's load average
before and after (the figures mean little on a busy machine; a
warning says so when the load exceeds the CPUs). ``make docs-assets`` does not
run it and keeps its file. vLLM's server beside it is ``make bench-serve``
with ``VLLM_VENV`` (the README keeps that comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OUT = os.path.join(ROOT, "docs", "assets", "recorded", "facts.bench_serve.json")
# What this script writes into docs/assets/recorded/ (make docs-assets keeps it).
OUTPUTS = ("facts.bench_serve.json",)
NUM_PROMPTS = 32
OUTPUT_LEN = 64


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _figures(result: dict[str, Any]) -> dict[str, Any]:
    """One run's figures, rounded as the chapter prints them."""
    out: dict[str, Any] = {
        "streams": result["max_concurrency"],
        "completed": result["completed"],
        "output_tokens": result["total_output_tokens"],
        "duration_s": round(result["duration"], 1),
        "output_tok_s": round(result["output_throughput"], 1),
    }
    for name in ("ttft", "itl", "tpot", "e2el"):
        for stat in ("mean", "median", "p99"):
            key = f"{stat}_{name}_ms"
            out[key] = round(result[key]) if name in ("ttft", "e2el") else round(result[key], 1)
    return out


def facts(alone: dict[str, Any], loaded: dict[str, Any], load: tuple[str, str]) -> dict[str, Any]:
    """What the chapter quotes: the lone stream, the loaded run, and their ratios."""
    one, many = _figures(alone), _figures(loaded)
    return {
        "bench_serve": {
            "output_len": OUTPUT_LEN,
            "alone": one,
            "loaded": many,
            "tok_s_ratio": round(many["output_tok_s"] / one["output_tok_s"], 1),
            "itl_ratio": round(many["median_itl_ms"] / one["median_itl_ms"], 1),
            "load_before": load[0],
            "load_after": load[1],
        }
    }


def _bench(port: int, streams: int, output_len: int) -> dict[str, Any]:
    from tracevllm.benchmarks.serve import benchmark, print_result

    args = argparse.Namespace(
        base_url=f"http://127.0.0.1:{port}", host=None, port=None, model="bench",
        api_key=None, num_prompts=streams, max_concurrency=streams,
        request_rate=float("inf"), output_len=output_len, metric_percentiles="50,99",
    )  # fmt: skip
    print(f"# {streams} stream(s) x {output_len} tokens", flush=True)
    result = asyncio.run(benchmark(args))
    print_result(result, "50,99")
    if result["failed"]:
        raise SystemExit(f"{result['failed']} requests failed: nothing recorded")
    return result


def main() -> int:
    import subprocess

    from tracevllm.entrypoints.openai.server_process import ServerProcess, free_port
    from tracevllm.model_executor.model_loader import resolve_model

    load_before = _load()
    cpus = os.cpu_count() or 1
    if os.getloadavg()[0] > cpus:
        print(f"warning: load average {load_before} on {cpus} CPUs: record on a quiet machine")
    port = free_port()
    cmd = [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", resolve_model(None),
           "--port", str(port), "--served-model-name", "bench"]  # fmt: skip
    with ServerProcess(cmd, port, timeout=900, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL):  # fmt: skip
        _bench(port, 4, 8)  # warm-up
        alone = _bench(port, 1, OUTPUT_LEN)
        loaded = _bench(port, NUM_PROMPTS, OUTPUT_LEN)
    with open(OUT, "w") as f:
        json.dump(facts(alone, loaded, (load_before, _load())), f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {os.path.relpath(OUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
