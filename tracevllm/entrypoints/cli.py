"""The ``tracevllm`` command: ``generate`` (and ``trace``, ``view``).

Mirrors vllm/entrypoints/cli/ in spirit (``vllm serve``/``vllm bench``);
tracevllm's subcommands are its own. Engine flags are ``EngineArgs``'s, with
vLLM's spelling (``--max-num-seqs``, ``--block-size`` ...).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from tracevllm.benchmarks import latency, sweep, throughput
from tracevllm.benchmarks import serve as bench_serve
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.entrypoints.openai.cli_args import make_arg_parser
from tracevllm.entrypoints.serve.disagg import proxy as disagg_proxy


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the user message")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1: fewer repeats")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--stop", action="append", default=None, metavar="S",
                        help="a stop string (again for more)")  # fmt: skip
    parser.add_argument("--raw", action="store_true", help="no chat template")
    so = parser.add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="FILE", help="output valid JSON for this schema")
    so.add_argument("--regex", metavar="R", help="output a full match of this regex")
    so.add_argument("--choice", metavar="A,B,C", help="output exactly one of these")


def _structured_outputs(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """``--json-schema FILE | --regex R | --choice A,B,C`` -> StructuredOutputsParams."""
    from tracevllm.sampling_params import StructuredOutputsParams

    if args.json_schema is not None:
        try:
            with open(args.json_schema) as f:
                return StructuredOutputsParams(json=f.read())
        except OSError as e:
            raise ValueError(f"--json-schema: cannot read {args.json_schema}: {e.strerror}") from e
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice is not None:
        return StructuredOutputsParams(choice=args.choice.split(","))
    return None


def _sampling_params(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tracevllm.sampling_params import SamplingParams

    return SamplingParams(
        structured_outputs=_structured_outputs(args),
        max_tokens=args.max_tokens,
        stop=args.stop,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tracevllm.entrypoints.llm import LLM

    console = Console()
    params = _sampling_params(args)
    engine_args = EngineArgs.from_cli_args(args)
    with LLM(**vars(engine_args)) as llm:
        if args.raw:
            outputs = llm.generate([args.prompt], params, use_tqdm=False)
        else:
            messages = [{"role": "user", "content": args.prompt}]
            outputs = llm.chat(messages, params, use_tqdm=False)
    completion = outputs[0].outputs[0]
    console.print(completion.text, markup=False, highlight=False)
    console.print(
        f"[dim]({len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})"
    )
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """Run one request with tracing on; write spans, Perfetto JSON and views."""
    import io
    import os

    from rich.console import Console

    from tracevllm import labs
    from tracevllm.entrypoints.llm import LLM
    from tracevllm.tracing import SPANS_FILE
    from tracevllm.tracing.exporters import read_spans_jsonl, write_perfetto
    from tracevllm.views.report import render_report

    console = Console()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    for name in (SPANS_FILE, "trace.perfetto.json", "views.svg", "views.html"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.trace_detail = args.detail
    engine_args.trace_dir = out
    engine_args.trace_live_views = True
    if args.no_mp:
        engine_args.enable_multiprocessing = False
    mode = "one process (--no-mp)" if args.no_mp else "two processes over ZeroMQ"
    if args.serve:
        mode = "three processes: HTTP client, API server, engine core"
    if args.disagg:
        mode = (
            "six processes: HTTP client, disagg proxy, prefill server + engine core,"
            " decode server + engine core"
        )
    world_size = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    if world_size > 1:  # the mp executor: a worker process per rank
        mode += (
            f", {world_size} workers (TP {engine_args.tensor_parallel_size}"
            f", PP {engine_args.pipeline_parallel_size})"
        )
    console.rule(f"tracevllm trace · {mode} · detail={args.detail}")
    if args.serve and args.disagg:
        raise ValueError("--serve and --disagg: choose one.")
    if args.disagg:
        from tracevllm.entrypoints.trace_disagg import trace_disagg

        answer = trace_disagg(args, engine_args, _sampling_params(args), out, console)
    elif args.serve:
        from tracevllm.entrypoints.trace_serve import trace_serve

        answer = trace_serve(args, engine_args, _sampling_params(args), out, console)
    else:
        with LLM(**vars(engine_args)) as llm:
            params = _sampling_params(args)
            if args.raw:
                outputs = llm.generate([args.prompt], params, use_tqdm=False)
            else:
                messages = [{"role": "user", "content": args.prompt}]
                outputs = llm.chat(messages, params, use_tqdm=False)
        answer = outputs[0].outputs[0].text
    # Every process has flushed its spans by now (shut down above).
    spans = read_spans_jsonl(os.path.join(out, SPANS_FILE))
    write_perfetto(spans, os.path.join(out, "trace.perfetto.json"))
    from tracevllm.views.ranks import render_ranks
    from tracevllm.views.waterfall import render_waterfall

    console.print(render_waterfall(spans))
    ranks = render_ranks(spans)
    if ranks is not None:  # worker processes: which rank holds what
        console.print(ranks)
    recorder = Console(record=True, width=140, file=io.StringIO())
    render_report(spans, recorder)
    # A plugged lab: where its function ran, or that it never did (and what
    # it needs), at the end of the run and in the recorded views.
    for ran, line in labs.run_report(labs.spans_by_lab(spans)):
        for where in (console, recorder):
            where.print(line, style="bold yellow" if ran else "bold red", highlight=False)
    # clear=False: save_svg would empty the recording that save_html saves.
    recorder.save_svg(os.path.join(out, "views.svg"), title="tracevllm trace", clear=False)
    recorder.save_html(os.path.join(out, "views.html"), inline_styles=True)
    pids = sorted({s.pid for s in spans})
    console.print(
        f"[bold]{len(spans)} spans[/] from {len(pids)} process(es) {pids}, "
        f"trace id(s): {', '.join(sorted({s.trace_id for s in spans}))}"
    )
    console.print(f"Answer: [bold green]{answer}[/]", highlight=False)
    for name in (SPANS_FILE, "trace.perfetto.json", "views.svg", "views.html"):
        console.print(f"  wrote {os.path.join(out, name)}")
    console.print("  open the Perfetto view with: make trace-view")
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    """Re-draw a saved run from its spans.jsonl."""
    from rich.console import Console

    from tracevllm.tracing.exporters import read_spans_jsonl
    from tracevllm.views.report import render_report

    render_report(read_spans_jsonl(args.spans), Console(), steps=not args.no_steps)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI API until Ctrl-C or SIGTERM; exit 1 if the engine died."""
    import asyncio

    from tracevllm.entrypoints.openai.api_server import BindError, run_server

    if args.model_tag is not None:
        args.model = args.model_tag

    def stop(signum: int, frame: object) -> None:
        # uvicorn drains the connections on SIGTERM / Ctrl-C, then raises the
        # signal again: that lands here, and the engine shuts down on the way out.
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        return asyncio.run(run_server(args))
    except BindError as e:
        print(f"error: {e.strerror}", file=sys.stderr)
        return 2


def cmd_disagg_proxy(args: argparse.Namespace) -> int:
    """The disaggregation proxy until Ctrl-C or SIGTERM."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)  # as cmd_serve: after uvicorn has drained

    signal.signal(signal.SIGTERM, stop)
    return disagg_proxy.run_disagg_proxy(args)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tracevllm", description="vLLM's V1 engine, small enough to read."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    tr = sub.add_parser("trace", help="run one request and record every stage")
    _add_sampling_args(tr)
    tr.add_argument("--out", default="traces/latest", help="directory for the files")
    tr.add_argument("--detail", choices=("request", "full"), default="request")
    tr.add_argument("--no-mp", action="store_true", help="engine core in this process")
    tr.add_argument(
        "--serve", action="store_true", help="through tracevllm serve and the openai client"
    )
    tr.add_argument(
        "--disagg",
        action="store_true",
        help="through tracevllm disagg-proxy to a prefill and a decode server (ExampleConnector)",
    )
    EngineArgs.add_cli_args(tr)
    tr.set_defaults(func=cmd_trace)

    serve = sub.add_parser("serve", help="the OpenAI-compatible server (as vllm serve)")
    make_arg_parser(serve)
    serve.set_defaults(func=cmd_serve)

    proxy = sub.add_parser(
        "disagg-proxy", help="prefill on one server, decode on another (vLLM's disagg proxy)"
    )
    disagg_proxy.add_cli_args(proxy)
    proxy.set_defaults(func=cmd_disagg_proxy)

    bench = sub.add_parser("bench", help="benchmarks, with vLLM's names (vllm bench)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for module, name, summary in (
        (bench_serve, "serve", "load a running OpenAI-compatible server"),
        (latency, "latency", "the latency of one batch, step by step"),
        (throughput, "throughput", "offline throughput of a dataset in one generate"),
        (sweep, "sweep", "max_num_seqs x max_num_batched_tokens under a TTFT/ITL target"),
    ):
        bench_parser = bench_sub.add_parser(name, help=summary)
        module.add_cli_args(bench_parser)
        bench_parser.set_defaults(func=module.main)

    view = sub.add_parser("view", help="re-draw a saved spans.jsonl")
    view.add_argument("spans", help="path to spans.jsonl")
    view.add_argument("--no-steps", action="store_true", help="only completions and waterfall")
    view.set_defaults(func=cmd_view)
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # As `vllm serve`: SIGTERM unwinds like Ctrl-C, so `with LLM(...)` shuts
    # the engine down and removes its sockets.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return int(args.func(args))
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
