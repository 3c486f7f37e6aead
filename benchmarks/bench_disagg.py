"""Disaggregated prefill: TTFT and ITL of a mixed workload, one engine vs a prefill/decode split.

``make bench-disagg``. The point of splitting prefill from decode (vLLM's
disaggregated serving) is that a decode step no longer waits behind a long
prefill: on one engine, a step that takes a 1,000-token prompt in with the
running requests' next tokens lasts as long as the prefill, and every
running request sees that step as one long inter-token gap. The workload
makes that happen: ``--num-short`` short chat requests start together and
decode ``--short-output-len`` tokens each; while they decode,
``--num-long`` long prompts (``--long-len`` tokens of their own, no shared
prefix) arrive ``--long-interval`` seconds apart from ``--long-start`` on,
each asking ``--long-output-len`` tokens. Every request is greedy, streamed
and ``ignore_eos``, sent by ``tracevllm bench serve``'s request function
(tracevllm/benchmarks/serve.py) and summed by its ``calculate_metrics``,
per class (short, long).

Two configurations, measured one after the other in one run (their servers
all start at once, since start-up is most of the run on a busy machine, and
the idle ones wait on their queues):

- ``one engine``: ``tracevllm serve`` alone with ``--one-threads`` torch
  threads (default: the split's two engines' together, 2 x ``--pd-threads``,
  at most the CPUs this process may run on: 2 at the default ``--pd-threads``);
- ``P/D split``: a prefill server (``kv_role="kv_producer"``) and a decode
  server (``kv_consumer``), both ``tracevllm serve`` with ``--pd-threads``
  torch threads each (default 1: a CPU each, the same two CPUs split in
  two), behind ``tracevllm disagg-proxy``, the KV moved by ``--connector``
  (``NixlConnector`` by default: the decode server's worker READs the
  prefill server's blocks over NIXL/UCX while the request waits in
  ``WAITING_FOR_REMOTE_KVS``; ``ExampleConnector``, the proxy tests'
  connector, through files).

Every engine's count is fixed (``TRACEVLLM_NUM_THREADS``, which also turns
the adaptive count off), whatever the caller's environment says, so that
both configurations run the same way; each configuration's setting is in
the JSON (``threads``).

After each configuration the servers' ``/metrics`` are read: the decode
server's ``vllm:external_prefix_cache_hits`` and
``vllm:prompt_tokens_by_source`` show the prompts it loaded instead of
computing. Printed: TTFT and ITL p50/p99 (and the largest gap) per class and
configuration, how many long arrivals fell while short requests were
decoding, and the machine's load average before and after each. Written:
``benchmarks/results/disagg.json`` (``--output-json``), which says what
every figure is.

What to expect here, and what the arithmetic predicts on real hardware.
This machine has two CPUs, shared with whatever else runs on it: the two
engines of the split are not two GPUs, they are two processes taking turns
on the same two cores (and the same memory bandwidth, which decode is bound
by), with two API servers and the proxy beside them. So the split cannot
add compute here; what it can change is the shape of the gaps. On one
engine, a long prompt's prefill sits inside a decode step, and the running
requests wait the whole prefill (a 1,024-token prompt is about 3.5 s of
forward on one core of this machine, ``make bench-roofline``): the short
requests' largest gap is about one prefill (their p99 too, once long
prompts land in more than 1% of their gaps). Split, the decode engine's
steps never contain a prefill; they only slow down while the prefill engine
shares the cores (by about the share it takes), so the largest gap should
fall from "a prefill" towards "a decode step on half the machine", and the
median gap rise (one thread per engine, the cores shared). The long
requests' prefill gets one CPU instead of two, plus the proxy's hop and the
KV transfer, but no longer shares its step with the decodes: which weighs
more depends on the load (README: in the recorded run their TTFT fell).

On real hardware the two engines run on two GPUs: the decode GPU's step
time does not depend on the prefills at all, so the short requests' ITL
stays at one decode step (memory-bound: the weights' bytes over HBM
bandwidth, about 5 ms for an 8B model in 16 bits on an H100) while on one
GPU a step holding a 1,024-token prefill of that model lasts about 2 x 8e9
x 1024 FLOP / ~500 TFLOP/s = ~33 ms more, a gap 8x a step; the price is the
KV transfer (128 KiB a token for Llama-3-8B, 134 MB for 1,024 tokens: ~0.3
ms over NVLink, ~3 ms over 400 Gb/s RDMA) and the proxy's hop in each long
request's TTFT, and the prefill GPU is idle whenever no prompt arrives. The figures for this run's
model and for Llama-3-8B, with their assumptions, are in the JSON
(``prediction``); ``predict()`` computes them.

Run: ``make bench-disagg`` or ``python benchmarks/bench_disagg.py [--model DIR]
[--connector ExampleConnector] ...``. Minutes on a quiet machine, most of
them the servers' start-up; 21 at a load average of 20-40.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from tracevllm.benchmarks.datasets import chat_prompts
from tracevllm.benchmarks.serve import (
    RequestFuncOutput,
    async_request_openai_chat_completions,
    calculate_metrics,
)
from tracevllm.entrypoints.openai.server_process import ServerProcess, free_port

MODEL = "bench"
PERCENTILES = [50.0, 99.0]
RESULT = os.path.join("benchmarks", "results", "disagg.json")
# GPU figures for predict() (dense 16-bit, datasheet): peak FLOP/s, HBM bytes/s.
H100 = {"name": "H100 SXM", "peak_flops": 989e12, "hbm_bytes_per_s": 3.35e12}
# What a prefill reaches of the peak (model FLOPs utilisation, an assumption).
MFU = 0.5
LINKS = {"NVLink (H100, one direction)": 450e9, "400 Gb/s RDMA": 50e9, "25 Gb/s TCP": 3.125e9}
# Llama-3-8B, for the prediction beside this run's model.
LLAMA3_8B = {"name": "Llama-3-8B", "params": 8.03e9, "num_layers": 32, "num_kv_heads": 8,
             "head_dim": 128}  # fmt: skip


@dataclass
class Sent:
    """One request: its class, when it was sent (s after the start), what came back."""

    kind: str  # "short" | "long"
    sent_s: float
    output: RequestFuncOutput

    def row(self) -> dict[str, Any]:
        o = self.output
        return {
            "kind": self.kind,
            "sent_s": self.sent_s,
            "success": o.success,
            "prompt_tokens": o.prompt_len,
            "output_tokens": o.output_tokens,
            "ttft_ms": o.ttft * 1e3,
            "e2el_ms": o.latency * 1e3,
            "itl_ms": [t * 1e3 for t in o.itl],
            "error": o.error,
        }


def long_prompts(tokenizer: Any, n: int, num_tokens: int, seed: int = 0) -> list[str]:
    """``n`` texts of ``num_tokens`` tokens each (before the chat template),
    made of seeded random words: no two share a prefix beyond a word or two."""
    words = [w for w in re.findall(r"[a-z]+", " ".join(chat_prompts(64)).lower()) if len(w) > 2]
    words = sorted(set(words))
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(num_tokens + 16))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:num_tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


def workload(args: argparse.Namespace, tokenizer: Any) -> list[tuple[str, float, str, int]]:
    """(kind, send time, prompt, output tokens) for every request, in send order."""
    shorts = [("short", 0.0, p, args.short_output_len) for p in chat_prompts(args.num_short)]
    longs = [
        ("long", args.long_start + i * args.long_interval, p, args.long_output_len)
        for i, p in enumerate(long_prompts(tokenizer, args.num_long, args.long_len))
    ]
    return shorts + longs


async def drive(url: str, requests: list[tuple[str, float, str, int]]) -> tuple[list[Sent], float]:
    """Send each request at its time, all streamed at once; (what came back, seconds)."""
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()

        async def one(kind: str, at: float, prompt: str, output_len: int) -> Sent:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            sent = time.perf_counter() - start
            out = await async_request_openai_chat_completions(
                client, url, MODEL, prompt, output_len, None
            )
            return Sent(kind, sent, out)

        sent = await asyncio.gather(*(one(*r) for r in requests))
        return list(sent), time.perf_counter() - start


def summarize(sent: list[Sent], duration: float) -> dict[str, Any]:
    """Per class: calculate_metrics' figures (TTFT, ITL, TPOT, E2EL at p50/p99)."""
    summary: dict[str, Any] = {}
    for kind in ("short", "long"):
        outputs = [s.output for s in sent if s.kind == kind]
        metrics = calculate_metrics(outputs, duration, PERCENTILES)
        metrics["max_itl_ms"] = max((t * 1e3 for o in outputs for t in o.itl), default=0.0)
        metrics["num_itl"] = sum(len(o.itl) for o in outputs if o.success)
        summary[kind] = metrics
    # Long arrivals that fell while some short request was between its first
    # and its last token (the case the workload is built for).
    decoding = [(s.sent_s + s.output.ttft, s.sent_s + s.output.latency) for s in sent
                if s.kind == "short" and s.output.success]  # fmt: skip
    summary["long_arrivals_during_short_decode"] = sum(
        any(a <= s.sent_s <= b for a, b in decoding) for s in sent if s.kind == "long"
    )
    return summary


def scrape(url: str) -> dict[str, float]:
    """The /metrics counters that say where prompt tokens came from."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    wanted = ("vllm:prompt_tokens_total", "vllm:prompt_tokens_by_source_total",
              "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
              "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total")  # fmt: skip
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            source = re.search(r'source="([^"]+)"', line)
            key = f"{name}[{source.group(1)}]" if source else name
            found[key] = float(line.rsplit(" ", 1)[1])
    return found


def serve_command(args: argparse.Namespace, port: int, kv: dict[str, Any] | None) -> list[str]:
    cmd = [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", args.model_dir,
           "--port", str(port), "--served-model-name", MODEL, "--uvicorn-log-level", "warning",
           "--max-model-len", str(args.max_model_len)]  # fmt: skip
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


Commands = dict[str, tuple[list[str], dict[str, str], int]]


def server_commands(args: argparse.Namespace, store: str) -> Commands:
    """Each server of both configurations: (command, environment, port).
    Every engine gets its thread count fixed (``TRACEVLLM_NUM_THREADS``): the
    one engine ``--one-threads``, each split engine ``--pd-threads``."""
    env = dict(os.environ)
    ports = {name: free_port() for name in ("one", "prefill", "decode", "proxy")}
    one_env = {**env, "TRACEVLLM_NUM_THREADS": str(args.one_threads)}
    commands: Commands = {"one": (serve_command(args, ports["one"], None), one_env, ports["one"])}
    extra = {"shared_storage_path": store} if args.connector == "ExampleConnector" else {}
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        kv = {"kv_connector": args.connector, "kv_role": role, "kv_connector_extra_config": extra}
        role_env = {**env, "TRACEVLLM_NUM_THREADS": str(args.pd_threads),
                    "TRACEVLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}  # fmt: skip
        commands[name] = (serve_command(args, ports[name], kv), role_env, ports[name])
    # The proxy answers /health once both of its backends do.
    commands["proxy"] = (
        [sys.executable, "-m", "tracevllm.entrypoints.cli", "disagg-proxy",
         "--port", str(ports["proxy"]), "--prefill", f"http://127.0.0.1:{ports['prefill']}",
         "--decode", f"http://127.0.0.1:{ports['decode']}", "--uvicorn-log-level", "warning"],
        env,
        ports["proxy"],
    )  # fmt: skip
    return commands


def thread_settings(commands: Commands, names: tuple[str, ...]) -> dict[str, Any]:
    """What each engine of a configuration was given: its
    ``TRACEVLLM_NUM_THREADS`` (None: unset, the adaptive default)."""
    settings: dict[str, Any] = {}
    for name in names:
        count = commands[name][1].get("TRACEVLLM_NUM_THREADS")
        settings[name] = {"TRACEVLLM_NUM_THREADS": None if count is None else int(count)}
    return settings


def start_all(commands: Commands, log: Any) -> dict[str, ServerProcess]:
    """Every server of both configurations, started at once (start-up is
    most of the run on a busy machine; an idle server waits on its queue).
    If one fails, the others are stopped and the error raised."""
    with ThreadPoolExecutor(len(commands)) as pool:
        starting = {
            name: pool.submit(
                ServerProcess,
                cmd,
                port,
                env=cmd_env,
                timeout=900,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            for name, (cmd, cmd_env, port) in commands.items()
        }
    failed = [e for f in starting.values() if (e := f.exception()) is not None]
    if failed:
        for f in starting.values():
            if f.exception() is None:
                f.result().stop()
        raise failed[0]
    return {name: f.result() for name, f in starting.items()}


def run_config(
    name: str, servers: dict[str, ServerProcess], requests: list[tuple[str, float, str, int]]
) -> dict[str, Any]:
    """Warm the configuration up, then run the workload through it."""
    load_before = os.getloadavg()
    split = name == "P/D split"
    url = servers["proxy" if split else "one"].url
    decode_url = servers["decode" if split else "one"].url
    chat_url = f"{url}/v1/chat/completions"
    # Warm-up, untimed: one short request (and, split, the first transfer's handshake).
    warm, _ = asyncio.run(drive(chat_url, [("short", 0.0, "Hello!", 4)]))
    if not warm[0].output.success:
        raise RuntimeError(f"{name}: the warm-up failed: {warm[0].output.error}")
    before = scrape(decode_url)
    sent, duration = asyncio.run(drive(chat_url, requests))
    after = scrape(decode_url)
    info: dict[str, Any] = {"config": name}
    info["decode_server_metrics"] = {k: after[k] - before.get(k, 0.0) for k in after}
    if split:
        info["prefill_server_metrics"] = scrape(servers["prefill"].url)
    info |= summarize(sent, duration)
    info["duration_s"] = duration
    info["requests"] = [s.row() for s in sent]
    info["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    return info


SERVERS = {
    "one engine": ["tracevllm serve, --one-threads torch threads"],
    "P/D split": [
        "prefill: tracevllm serve, kv_producer, --pd-threads torch threads",
        "decode: tracevllm serve, kv_consumer, --pd-threads torch threads",
        "tracevllm disagg-proxy in front of them",
    ],
}


# Each configuration's engines (their servers' names in server_commands).
ENGINES = {"one engine": ("one",), "P/D split": ("prefill", "decode")}


def predict(hf: dict[str, Any], long_len: int, name: str = "this run's model") -> dict[str, Any]:
    """What one GPU vs a prefill GPU + a decode GPU would show (H100, 16 bits).

    Decode step (memory-bound at small batch): weight bytes / HBM bandwidth.
    A prefill of L tokens: 2 x params x L FLOP at MFU of the peak. One GPU:
    a decode step that takes a long prompt in lasts step + prefill, so the
    running requests' worst gap is about that. Split: the decode GPU's steps
    hold no prefill (the KV arrives over a link while the request waits),
    the gap stays one step; the long request's TTFT gains the transfer.
    """

    def one(model: dict[str, Any]) -> dict[str, Any]:
        weight_bytes = 2 * model["params"]
        step_s = weight_bytes / H100["hbm_bytes_per_s"]
        prefill_s = 2 * model["params"] * long_len / (MFU * H100["peak_flops"])
        kv_bytes = 2 * model["num_layers"] * model["num_kv_heads"] * model["head_dim"] * 2
        transfer = {link: long_len * kv_bytes / bw for link, bw in LINKS.items()}
        return {
            "model": model["name"],
            "decode_step_ms": step_s * 1e3,
            "prefill_ms": prefill_s * 1e3,
            "one_gpu_worst_itl_ms": (step_s + prefill_s) * 1e3,
            "split_worst_itl_ms": step_s * 1e3,
            "kv_bytes_per_token": kv_bytes,
            "kv_transfer_ms": {k: v * 1e3 for k, v in transfer.items()},
        }

    num_heads = hf["num_attention_heads"]
    this = {
        "name": name,
        "params": _params(hf),
        "num_layers": hf["num_hidden_layers"],
        "num_kv_heads": hf.get("num_key_value_heads", num_heads),
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // num_heads,
    }
    return {
        "gpu": H100,
        "mfu": MFU,
        "long_len": long_len,
        "dtype_bytes": 2,
        "models": [one(this), one(LLAMA3_8B)],
        "how": predict.__doc__,
    }


def _params(hf: dict[str, Any]) -> float:
    """A Llama's parameter count from its config (embeddings counted once if tied)."""
    h, inter, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", heads)
    head_dim = hf.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    per_layer = attn + 3 * h * inter
    embed = hf["vocab_size"] * h * (1 if hf.get("tie_word_embeddings") else 2)
    return float(layers * per_layer + embed)


def print_table(configs: list[dict[str, Any]]) -> None:
    head = f"{'':<12}{'class':<7}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>10}{'p99':>9}{'max':>9}"
    print("\n" + head + "   (ms)")
    for c in configs:
        for kind in ("short", "long"):
            m = c[kind]
            print(
                f"{c['config']:<12}{kind:<7}{m['median_ttft_ms']:>10.0f}{m['p99_ttft_ms']:>9.0f}"
                f"{m['median_itl_ms']:>10.0f}{m['p99_itl_ms']:>9.0f}{m['max_itl_ms']:>9.0f}"
            )
    for c in configs:
        for error in [e for k in ("short", "long") for e in c[k]["errors"]][:1]:
            print(f"{c['config']}: first error: {error}")
        load = c["load_average"]
        done = sum(c[k]["completed"] for k in ("short", "long"))
        failed = sum(c[k]["failed"] for k in ("short", "long"))
        print(
            f"{c['config']}: {done} done, {failed} failed; long arrivals while shorts decoded: "
            f"{c['long_arrivals_during_short_decode']}; load average {load['before'][0]:.1f} "
            f"before, {load['after'][0]:.1f} after"
        )
        ext = c["decode_server_metrics"]
        print(
            f"  decode server: prompt tokens {ext.get('vllm:prompt_tokens_total', 0):.0f}, "
            f"computed {ext.get('vllm:prompt_tokens_by_source_total[local_compute]', 0):.0f}, "
            f"loaded through the connector "
            f"{ext.get('vllm:prompt_tokens_by_source_total[external_kv_transfer]', 0):.0f}"
        )


def default_one_threads(pd_threads: int) -> int:
    """``--one-threads``' default: the split's two engines' threads together,
    capped at the CPUs this process may run on (its affinity, which a
    container's or taskset's limit narrows; ``os.cpu_count()`` does not)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(2 * pd_threads, usable or 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: tracevllm's default model")
    parser.add_argument("--connector", default="NixlConnector",
                        choices=("NixlConnector", "ExampleConnector"))  # fmt: skip
    parser.add_argument("--num-short", type=int, default=4)
    parser.add_argument("--short-output-len", type=int, default=128)
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument("--long-start", type=float, default=3.0, help="s after the shorts")
    parser.add_argument("--long-interval", type=float, default=3.0, help="s between longs")
    parser.add_argument(
        "--pd-threads", type=int, default=1, help="each split engine's TRACEVLLM_NUM_THREADS"
    )
    parser.add_argument(
        "--one-threads",
        type=int,
        default=None,
        help="the one engine's TRACEVLLM_NUM_THREADS (default: the split's two engines' "
        "together, 2 x --pd-threads, at most the CPUs this process may run on)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--output-json", default=RESULT)
    parser.add_argument(
        "--log", default=None, help="append the servers' output here (default: shown on failure)"
    )
    args = parser.parse_args(argv)
    if args.one_threads is None and args.pd_threads >= 1:
        args.one_threads = default_one_threads(args.pd_threads)
    if args.pd_threads < 1 or args.one_threads is None or args.one_threads < 1:
        parser.error("--pd-threads and --one-threads must be at least 1")
    return args


def main() -> int:
    args = parse_args()

    import torch
    from transformers import AutoTokenizer

    from tracevllm.model_executor.model_loader import resolve_model

    args.model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    with open(os.path.join(args.model_dir, "config.json")) as f:
        hf = json.load(f)
    requests = workload(args, tokenizer)
    print(
        f"{args.num_short} short requests x {args.short_output_len} tokens from t=0; "
        f"{args.num_long} prompts of {args.long_len} tokens (x {args.long_output_len} out) "
        f"at t={args.long_start:g}s every {args.long_interval:g}s. Connector {args.connector}. "
        f"{os.cpu_count()} CPUs, shared with other work: figures are noisy.",
        flush=True,
    )
    configs = []
    store = tempfile.mkdtemp(prefix="tracevllm-bench-disagg-")
    log_path = args.log or os.path.join(store, "servers.log")
    try:
        with open(log_path, "a") as log:
            print("starting the servers of both configurations ...", flush=True)
            started = time.perf_counter()
            commands = server_commands(args, store)
            servers = start_all(commands, log)
            startup_s = time.perf_counter() - started
            try:
                for name in ("one engine", "P/D split"):
                    print(f"=== {name} ...", flush=True)
                    run = run_config(name, servers, requests)
                    threads = thread_settings(commands, ENGINES[name])
                    configs.append({**run, "servers": SERVERS[name], "threads": threads})
            finally:
                for server in servers.values():
                    server.stop()
    except BaseException:
        # What the servers said, before their folder goes.
        with open(log_path, errors="replace") as f:
            print("".join(f.readlines()[-60:]), file=sys.stderr)
        raise
    finally:
        shutil.rmtree(store, ignore_errors=True)
    print_table(configs)
    model_name = os.path.basename(os.path.normpath(args.model_dir))
    prediction = predict(hf, args.long_len, model_name)
    for m in prediction["models"]:
        print(
            f"H100 arithmetic, {m['model']}: decode step {m['decode_step_ms']:.2f} ms, "
            f"{args.long_len}-token prefill {m['prefill_ms']:.2f} ms: worst ITL one GPU "
            f"{m['one_gpu_worst_itl_ms']:.2f} ms, split {m['split_worst_itl_ms']:.2f} ms"
        )
    result = {
        "what": (
            "TTFT and ITL (ms; p50, p99, max) of short streamed chat requests decoding while "
            "long prompts arrive, on one tracevllm engine and on a prefill/decode split (two "
            "engines behind tracevllm disagg-proxy), from one run on one machine. 'short' and "
            "'long' hold tracevllm bench serve's calculate_metrics per class (median_*, p50_*, "
            "p99_*, mean_*, in ms) plus max_itl_ms and num_itl; 'requests' each request's "
            "send time, TTFT, end-to-end latency and gaps; decode_server_metrics the decode "
            "server's Prometheus counters over the run (external_kv_transfer: prompt tokens "
            "loaded from the prefill engine, not computed); load_average: os.getloadavg() "
            "(1, 5, 15 min) before and after each configuration; threads: each engine's "
            "TRACEVLLM_NUM_THREADS (a fixed torch thread count, the adaptive one off); "
            "prediction: the same "
            "workload's arithmetic on H100s (see its 'how')."
        ),
        "command": "python benchmarks/bench_disagg.py " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads_default": torch.get_num_threads(),
            "shared": "yes: other work ran on the same CPUs; the load average says how much",
            "note": "the split's two engines share these CPUs; they are not two GPUs",
        },
        "model": model_name,
        "startup_s": startup_s,
        "servers_up_together": (
            "the servers of both configurations (three tracevllm serve and the proxy) were "
            "started at once and stayed up; each configuration ran while the other's sat idle"
        ),
        "workload": {
            k: v for k, v in vars(args).items() if k not in ("output_json", "log", "model_dir")
        },
        "configs": configs,
        "prediction": prediction,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1, default=_jsonable)
    print(f"wrote {args.output_json}")
    failed = sum(c[k]["failed"] for c in configs for k in ("short", "long"))
    return 1 if failed else 0


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
