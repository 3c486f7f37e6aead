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

The trade-off it finds: more sequences a step (``max_num_seqs``) raise
throughput and each step's time (ITL); a bigger token budget
(``max_num_batched_tokens``) finishes prefills sooner (TTFT) but a decode step
that shares the budget with a long prefill chunk takes longer (ITL spikes).
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--output-json", default=None, help="write every config's results here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    EngineArgs.add_cli_args(parser)


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
    _, samples = load_samples(args)
    console = Console()
    grid = [(s, b) for s in args.max_num_seqs_list for b in args.max_num_batched_tokens_list]
    console.print(
        f"sweep: {len(grid)} configs x {len(samples)} requests "
        f"({sum(s.expected_output_len for s in samples)} output tokens each), "
        f"request rate {args.request_rate}"
    )
    results = []
    for seqs, budget in grid:
        name = f"max_num_seqs={seqs} max_num_batched_tokens={budget}"
        with make_llm(args, max_num_seqs=seqs, max_num_batched_tokens=budget) as llm:
            run_timed(llm, samples[:2], show_progress=False)  # warm-up
            run = run_timed(llm, samples, request_rate=args.request_rate, description=name,
                            show_progress=not args.no_progress)  # fmt: skip
        metrics = calculate_metrics(run.outputs, run.duration, sorted({50.0, 90.0, 99.0, pct}))
        results.append({"max_num_seqs": seqs, "max_num_batched_tokens": budget} | metrics)
    best = pick_best(results, args.max_ttft_ms, args.max_itl_ms, pct)
    target = " and ".join(
        f"P{pct:g} {what} <= {limit:g} ms"
        for what, limit in (("TTFT", args.max_ttft_ms), ("ITL", args.max_itl_ms))
        if limit is not None
    )
    table = Table(
        title=f"bench sweep (target: {target or 'none, best throughput'})",
        caption="seqs: --max-num-seqs, tokens: --max-num-batched-tokens",
    )
    p = f"P{pct:g}"
    for col in ("seqs", "tokens", "output tok/s", "req/s", f"{p} TTFT ms", f"{p} ITL ms",
                "mean TPOT ms", "meets target"):  # fmt: skip
        table.add_column(col, justify="right")
    for i, r in enumerate(results):
        r["meets_target"] = meets_target(r, args.max_ttft_ms, args.max_itl_ms, pct)
        table.add_row(
            str(r["max_num_seqs"]), str(r["max_num_batched_tokens"]),
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
        console.print(
            f"[bold]Best: --max-num-seqs {w['max_num_seqs']} --max-num-batched-tokens "
            f"{w['max_num_batched_tokens']}[/] ({w['output_throughput']:.1f} output tok/s)"
        )
    if args.output_json:
        write_json(args.output_json, {
            "target": {"max_ttft_ms": args.max_ttft_ms, "max_itl_ms": args.max_itl_ms,
                       "percentile": pct},
            "configs": results,
            "winner": None if best is None else results[best],
        })  # fmt: skip
    return 0 if best is not None else 1
