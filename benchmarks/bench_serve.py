"""``make bench-serve``: tracevllm serve (and vLLM's server, when installed) under load.

Starts ``tracevllm serve`` on the default model, warms it up, then runs
``tracevllm bench serve`` against it: 32 concurrent streams of 64 tokens each
(``--num-prompts``/``--output-len`` to change). With ``VLLM_VENV`` naming a venv
that holds the real vLLM CPU build (``bash benchmarks/setup_vllm_venv.sh``),
the same client then loads vLLM's own server on the same weights, in the same
run, and both results are printed side by side. Results go to
``bench-results/`` as JSON.

Run: ``make bench-serve`` or ``python benchmarks/bench_serve.py [--num-prompts N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from typing import Any

from tracevllm.benchmarks.serve import benchmark, print_result
from tracevllm.entrypoints.openai.server_process import ServerProcess, free_port

RESULT_DIR = "bench-results"


def run_against(cmd: list[str], env: dict[str, str], port: int, args: Any, label: str) -> dict:
    print(f"\n=== {label}: {' '.join(cmd)}", flush=True)
    with ServerProcess(cmd, port, env=env, timeout=900, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL):  # fmt: skip
        bench_args = argparse.Namespace(
            base_url=f"http://127.0.0.1:{port}", host=None, port=None, model="bench",
            api_key=None, num_prompts=args.num_prompts, max_concurrency=args.num_prompts,
            request_rate=float("inf"), output_len=args.output_len, metric_percentiles="50,90,99",
        )  # fmt: skip
        warmup = argparse.Namespace(**{**vars(bench_args), "num_prompts": 4, "output_len": 8})
        asyncio.run(benchmark(warmup))
        result = asyncio.run(benchmark(bench_args))
    result["label"] = label
    print_result(result, "50,90,99")
    return result


def main() -> int:
    import json

    from tracevllm.model_executor.model_loader import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    model_dir = resolve_model(None)
    results = []

    port = free_port()
    cmd = [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", model_dir,
           "--port", str(port), "--served-model-name", "bench"]  # fmt: skip
    results.append(run_against(cmd, dict(os.environ), port, args, "tracevllm"))

    venv = os.environ.get("VLLM_VENV")
    if venv:
        port = free_port()
        cmd = [os.path.join(venv, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", model_dir, "--dtype", "float32", "--port", str(port),
               "--served-model-name", "bench"]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
        results.append(run_against(cmd, env, port, args, "vllm-cpu"))
    else:
        print("\n(VLLM_VENV not set: vLLM's own server not measured; see setup_vllm_venv.sh)")

    os.makedirs(RESULT_DIR, exist_ok=True)
    path = os.path.join(RESULT_DIR, "bench-serve.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\n{args.num_prompts} streams x {args.output_len} tokens, one run, this machine:")
    print(f"{'':<12}{'output tok/s':>14}{'TTFT p50 ms':>14}{'ITL p50 ms':>12}{'E2EL p50 ms':>14}")
    for r in results:
        print(
            f"{r['label']:<12}{r['output_throughput']:>14.1f}{r['median_ttft_ms']:>14.1f}"
            f"{r['median_itl_ms']:>12.1f}{r['median_e2el_ms']:>14.1f}"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
