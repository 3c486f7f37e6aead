"""``tracevllm trace --disagg``: one chat request through the disaggregation proxy, in one trace.

tracevllm's own (``make trace-disagg``). It starts a prefill server
(``kv_role="kv_producer"``) and a decode server (``kv_consumer``), both
``tracevllm serve`` with tracing on, the engine flags given to ``trace`` and
an ``ExampleConnector`` over a folder of their own, then ``tracevllm
disagg-proxy`` in front of them; sends one streamed chat request through the
proxy as ``--serve`` does (``traced_chat``); stops them all and removes the
folder. The spans of the six processes land in one ``spans.jsonl``: the
client, the proxy, the prefill server and its engine core, the decode server
and its engine core, all in the client's trace.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console

from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.entrypoints.openai.server_process import ServerProcess, free_port
from tracevllm.entrypoints.trace_serve import engine_flags, traced_chat
from tracevllm.sampling_params import SamplingParams

MODEL = "tracevllm"


def serve_command(
    role: str, port: int, store: str, trace_detail: str, trace_dir: str, flags: list[str]
) -> list[str]:
    """``tracevllm serve`` as a KV producer or consumer through ``store``, traced."""
    kv_transfer_config = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": store},
    }
    return [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", "--port", str(port),
            "--trace-detail", trace_detail, "--trace-dir", trace_dir,
            "--served-model-name", MODEL, "--uvicorn-log-level", "warning", *flags,
            "--kv-transfer-config", json.dumps(kv_transfer_config)]  # fmt: skip


def proxy_command(
    port: int, prefill: list[str], decode: list[str], trace_detail: str, trace_dir: str
) -> list[str]:
    """``tracevllm disagg-proxy`` in front of these servers, traced."""
    cmd = [sys.executable, "-m", "tracevllm.entrypoints.cli", "disagg-proxy", "--port", str(port),
           "--trace-detail", trace_detail, "--trace-dir", trace_dir,
           "--uvicorn-log-level", "warning"]  # fmt: skip
    for url in prefill:
        cmd += ["--prefill", url]
    for url in decode:
        cmd += ["--decode", url]
    return cmd


def start_servers(commands: list[tuple[list[str], int]]) -> list[ServerProcess]:
    """Start these servers at once; if one fails, stop the others and raise."""
    with ThreadPoolExecutor(len(commands)) as pool:
        starting = [pool.submit(ServerProcess, cmd, port) for cmd, port in commands]
    failed = [e for f in starting if (e := f.exception()) is not None]
    if failed:
        for f in starting:
            if f.exception() is None:
                f.result().stop()
        raise failed[0]
    return [f.result() for f in starting]


def trace_disagg(
    args: Namespace, engine_args: EngineArgs, params: SamplingParams, out: str, console: Console
) -> str:
    """Run the request through the proxy; returns the answer's text."""
    if args.raw:
        raise ValueError("--raw has no meaning with --disagg: the servers apply the chat template.")
    store = tempfile.mkdtemp(prefix="tracevllm-disagg-kv-")
    flags = engine_flags(engine_args)
    ports = [free_port(), free_port()]
    try:
        with console.status("starting the prefill and the decode server ..."):
            prefill, decode = start_servers(
                [
                    (serve_command(role, port, store, args.detail, out, flags), port)
                    for role, port in zip(("kv_producer", "kv_consumer"), ports)
                ]
            )
        try:
            port = free_port()
            with console.status("starting tracevllm disagg-proxy ..."):
                proxy = ServerProcess(
                    proxy_command(port, [prefill.url], [decode.url], "request", out), port
                )
            try:
                answer = traced_chat(proxy.url, MODEL, args.prompt, params, out)
            finally:
                proxy.stop()
        finally:
            # Each drains, shuts its engine down, and flushes its spans.
            for server in (prefill, decode):
                server.stop()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return answer
