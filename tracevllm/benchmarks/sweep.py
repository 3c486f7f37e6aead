"""``tracevllm bench sweep``: the batch limits that give the most throughput under a latency target.

vLLM's auto-tune idea (benchmarks/auto_tune/ in its repository: run the
workload under each ``max_num_seqs`` x ``max_num_batched_tokens``, keep the
best throughput whose latency meets the target), offline and small: one
fresh engine per pair of the grid, the same requests through each (a
dataset of datasets.py; by default 32 chat prompts x 32 tokens, all arriving
at once, or as a Poisson stream with ``--request-rate``), every token timed
(offline.py). A config meets the target when its ``--target-percentile``
(default 99) TTFT is at most ``--max-ttft-ms`` and its ITL at most
``--max-itl-ms``; the winner is the one of those with the highest output
tokens/s. No target: the highest throughput wins. None meets it: no winner,
exit status 1.

``--serve-params FILE`` (vLLM's ``vllm bench sweep serve --serve-params``,
vllm/benchmarks/sweep/param_sweep.py: a JSON list of parameter dicts, or a
dict of them by name) sweeps any engine knob instead of the grid: each item
is one config, its keys ``EngineArgs`` fields (``enable_prefix_caching``,
``long_prefill_token_threshold``, ``speculative_config`` ...; dashes or
underscores), ``_benchmark_name`` its label, and a ``TRACEVLLM_*`` key an
environment variable of envs.py set for that config's engine (the CPU
thread settings, which are not engine flags). vLLM's sweep runs a server and
``vllm bench serve`` per config; this one runs the offline engine, and
repeats each config ``--num-runs`` times (vLLM's flag; default 1 here),
reporting the median run by throughput.

The trade-off it finds: more sequences a step (``max_num_seqs``) raise
throughput and each step's time (ITL); a bigger token budget
(``max_num_batched_tokens``) finishes prefills sooner (TTFT) but a decode step
that shares the budget with a long prefill chunk takes longer (ITL spikes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tracevllm.benchmarks.datasets import add_dataset_args
from tracevllm.benchmarks.offline import make_llm, run_timed, write_json
from tracevllm.benchmarks.serve import calculate_metrics


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {text!r}")
    return values


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from tracevllm.engine.arg_utils import EngineArgs

    add_dataset_args(parser, num_prompts=32)
    parser.set_defaults(output_len=32)
    parser.add_argument("--max-num-seqs-list", type=_int_list, default=[4, 16, 64],
                        metavar="N,N,...", help="max_num_seqs values to try")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens-list", type=_int_list, default=[256, 2048],
                        metavar="N,N,...", help="max_num_batched_tokens values to try")  # fmt: skip
    parser.add_argument("--max-ttft-ms", type=float, default=None, help="TTFT target")
    parser.add_argument("--max-itl-ms", type=float, default=None, help="ITL target")
    parser.add_argument("--target-percentile", type=float, default=99.0,
                        help="the percentile the targets apply to")  # fmt: skip
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s (Poisson, seeded); inf: all at once")  # fmt: skip
    parser.add_argument("--serve-params", default=None, metavar="FILE|JSON",
                        help="configs to sweep instead of the grid: a JSON list of "
                        "{engine arg: value} (or a dict of them by name), "
                        "or a file of one")  # fmt: skip
    parser.add_argument("--num-runs", type=int, default=1, help="runs per config (median kept)")
    parser.add_argument("--output-json", default=None, help="write every config's results here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    EngineArgs.add_cli_args(parser)


def load_serve_params(text: str) -> list[dict[str, Any]]:
    """``--serve-params``: a JSON list of parameter dicts, a dict of them by
    name, or a file holding either (vLLM's ``ParameterSweep.read_json``).
    Each dict is checked: an ``EngineArgs`` field (dashes become
    underscores), ``_benchmark_name``, or a ``TRACEVLLM_*`` variable of
    envs.py (its value a string or a number)."""
    from tracevllm import envs
    from tracevllm.engine.arg_utils import EngineArgs

    if os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--serve-params: not JSON, nor a file of it: {e}") from None
    if isinstance(data, dict):
        data = [{"_benchmark_name": name, **params} for name, params in data.items()]
    if not isinstance(data, list) or not data or not all(isinstance(d, dict) for d in data):
        raise ValueError("--serve-params: expected a non-empty JSON list of objects.")
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    configs = []
    for i, item in enumerate(data):
        config: dict[str, Any] = {}
        for key, value in item.items():
            name = key if key.startswith("TRACEVLLM_") else key.replace("-", "_")
            if name.startswith("TRACEVLLM_"):
                if name not in envs.environment_variables:
                    raise ValueError(f"--serve-params[{i}]: {key} is not a variable of envs.py.")
                if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                    raise ValueError(f"--serve-params[{i}]: {key} must be a string or a number.")
            elif name != "_benchmark_name" and name not in fields:
                raise ValueError(
                    f"--serve-params[{i}]: {key!r} is not an engine argument (EngineArgs field)."
                )
            config[name] = value
        configs.append(config)
    names = [c["_benchmark_name"] for c in configs if "_benchmark_name" in c]
    if len(names) != len(set(names)):
        raise ValueError(f"--serve-params: duplicate _benchmark_name in {names}.")
    return configs


def config_name(config: dict[str, Any]) -> str:
    if "_benchmark_name" in config:
        return str(config["_benchmark_name"])
    return " ".join(f"{k}={json.dumps(v)}" for k, v in config.items()) or "defaults"


@contextmanager
def _environment(config: dict[str, Any]) -> Iterator[None]:
    """The config's TRACEVLLM_* variables, set while its engine runs."""
    saved = {k: os.environ.get(k) for k in config if k.startswith("TRACEVLLM_")}
    os.environ.update({k: str(config[k]) for k in saved})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --8<-- [start:run_sweep]
def run_sweep(
    args: argparse.Namespace,
    configs: list[dict[str, Any]],
    samples: list[Any],
    percentiles: list[float],
    console: Any = None,
) -> list[dict[str, Any]]:
    """Each config: a fresh engine (the command's engine flags, the config's
    over them), a warm-up, then the samples, ``args.num_runs`` times; the
    metrics of its median run by output throughput, with the config's keys."""
    if args.num_runs < 1:
        raise ValueError(f"--num-runs must be >= 1, got {args.num_runs}.")
    results = []
    for config in configs:
        name = config_name(config)
        engine = {k: v for k, v in config.items() if not k.startswith(("_", "TRACEVLLM_"))}
        runs = []
        with _environment(config), make_llm(args, **engine) as llm:
            # What the engine was built with (the config's knobs, as it read them).
            vllm_config = llm.llm_engine.vllm_config
            sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
            spec = vllm_config.speculative_config
            built = {
                "max_num_seqs": sched.max_num_seqs,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "long_prefill_token_threshold": sched.long_prefill_token_threshold,
                "enable_prefix_caching": cache.enable_prefix_caching,
                "block_size": cache.block_size,
                "num_speculative_tokens": spec.num_speculative_tokens if spec else 0,
            }
            run_timed(llm, samples[:2], show_progress=False)  # warm-up
            for _ in range(args.num_runs):
                run = run_timed(llm, samples, request_rate=args.request_rate, description=name,
                                show_progress=not args.no_progress)  # fmt: skip
                runs.append(calculate_metrics(run.outputs, run.duration, percentiles))
        runs.sort(key=lambda r: r["output_throughput"])
        metrics = runs[len(runs) // 2]
        metrics["output_throughput_runs"] = [r["output_throughput"] for r in runs]
        if console is not None and args.num_runs > 1:
            spread = ", ".join(f"{r:.1f}" for r in metrics["output_throughput_runs"])
            console.print(f"  {name}: output tok/s of each run {spread}")
        results.append({"name": name, **config} | metrics | {"engine": built})
    return results


# --8<-- [end:run_sweep]


def meets_target(
    result: dict[str, Any], max_ttft_ms: float | None, max_itl_ms: float | None, pct: float
) -> bool:
    if max_ttft_ms is not None and result[f"p{pct:g}_ttft_ms"] > max_ttft_ms:
        return False
    return max_itl_ms is None or result[f"p{pct:g}_itl_ms"] <= max_itl_ms


def pick_best(
    results: list[dict[str, Any]], max_ttft_ms: float | None, max_itl_ms: float | None, pct: float
) -> int | None:
    """Index of the highest output throughput among the configs meeting the target."""
    ok = [i for i, r in enumerate(results) if meets_target(r, max_ttft_ms, max_itl_ms, pct)]
    return max(ok, key=lambda i: results[i]["output_throughput"]) if ok else None


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tracevllm.benchmarks.throughput import load_samples

    pct = args.target_percentile
    if not 0 <= pct <= 100:
        raise ValueError(f"--target-percentile must be in [0, 100], got {pct}.")
    if args.serve_params is not None:
        configs = load_serve_params(args.serve_params)
    else:
        configs = [
            {"max_num_seqs": s, "max_num_batched_tokens": b}
            for s in args.max_num_seqs_list
            for b in args.max_num_batched_tokens_list
        ]
    _, samples = load_samples(args)
    console = Console()
    console.print(
        f"sweep: {len(configs)} configs x {len(samples)} requests "
        f"({sum(s.expected_output_len for s in samples)} output tokens each), "
        f"request rate {args.request_rate}"
    )
    results = run_sweep(args, configs, samples, sorted({50.0, 90.0, 99.0, pct}), console)
    best = pick_best(results, args.max_ttft_ms, args.max_itl_ms, pct)
    target = " and ".join(
        f"P{pct:g} {what} <= {limit:g} ms"
        for what, limit in (("TTFT", args.max_ttft_ms), ("ITL", args.max_itl_ms))
        if limit is not None
    )
    grid = args.serve_params is None
    table = Table(
        title=f"bench sweep (target: {target or 'none, best throughput'})",
        caption="seqs: --max-num-seqs, tokens: --max-num-batched-tokens" if grid else None,
    )
    p = f"P{pct:g}"
    for col in (("seqs", "tokens") if grid else ("config",)) + ("output tok/s", "req/s",
                f"{p} TTFT ms", f"{p} ITL ms", "mean TPOT ms", "meets target"):  # fmt: skip
        table.add_column(col, justify="left" if col == "config" else "right")
    for i, r in enumerate(results):
        r["meets_target"] = meets_target(r, args.max_ttft_ms, args.max_itl_ms, pct)
        first = (str(r["max_num_seqs"]), str(r["max_num_batched_tokens"])) if grid else (r["name"],)
        table.add_row(
            *first,
            f"{r['output_throughput']:.1f}", f"{r['request_throughput']:.2f}",
            f"{r[f'p{pct:g}_ttft_ms']:.1f}", f"{r[f'p{pct:g}_itl_ms']:.1f}",
            f"{r['mean_tpot_ms']:.1f}", ("[bold green]winner" if i == best else "yes")
            if r["meets_target"] else "[red]no",
        )  # fmt: skip
    console.print(table)
    if best is None:
        console.print(f"[bold red]No config meets the target ({target}).[/]")
    else:
        w = results[best]
        console.print(f"[bold]Best: {w['name']}[/] ({w['output_throughput']:.1f} output tok/s)")
    if args.output_json:
        write_json(args.output_json, {
            "target": {"max_ttft_ms": args.max_ttft_ms, "max_itl_ms": args.max_itl_ms,
                       "percentile": pct},
            "configs": results,
            "winner": None if best is None else results[best],
        })  # fmt: skip
    return 0 if best is not None else 1
