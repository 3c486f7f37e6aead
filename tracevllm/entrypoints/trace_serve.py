"""``tracevllm trace --serve``: one chat request through the server, in one trace.

tracevllm's own (``make trace-serve``). It starts ``tracevllm serve`` with
tracing on and the engine flags given to ``trace``, sends one streamed chat
request with the official ``openai`` client under a client span of its own
(its ``traceparent`` rides in the HTTP headers), with the sampling flags given
to ``trace`` (vLLM's extra ones in ``extra_body``), stops the server, and
leaves the spans of all three processes in one ``spans.jsonl``: the client,
the API server and the engine core. ``tracevllm trace`` then draws them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from argparse import Namespace
from typing import Any

import msgspec
from opentelemetry import trace
from rich.console import Console

from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.entrypoints.openai.server_process import ServerProcess, free_port
from tracevllm.sampling_params import SamplingParams

# The server's own tracing flags are set here, not forwarded.
_NOT_FORWARDED = {"trace_detail", "trace_dir", "trace_live_views", "enable_multiprocessing"}


def engine_flags(engine_args: EngineArgs) -> list[str]:
    """The engine flags that differ from their defaults, as `tracevllm serve` takes them."""
    flags: list[str] = []
    for field in dataclasses.fields(EngineArgs):
        value = getattr(engine_args, field.name)
        if field.name in _NOT_FORWARDED or value == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def openai_kwargs(params: SamplingParams) -> dict[str, Any]:
    """The client call's arguments for these SamplingParams (vLLM's extras in extra_body)."""
    extra: dict[str, Any] = {"top_k": params.top_k, "repetition_penalty": params.repetition_penalty}
    if params.structured_outputs is not None:
        extra["structured_outputs"] = msgspec.to_builtins(params.structured_outputs)
    return dict(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        extra_body=extra,
    )


def traced_chat(url: str, model: str, prompt: str, params: SamplingParams, out: str) -> str:
    """One streamed chat request to the server at ``url`` under a client span of
    its own (its ``traceparent`` in the HTTP headers), written to ``out``."""
    import openai

    from tracevllm import tracing
    from tracevllm.config import TraceConfig

    # The client's spans go to the same spans.jsonl as the server's.
    tracing.init_tracer("client", TraceConfig(detail="request", out_dir=out))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        with tracing.get_tracer().start_as_current_span(
            "openai.chat.completions.create",
            kind=trace.SpanKind.CLIENT,
            attributes={"http.request.method": "POST", "url.path": "/v1/chat/completions"},
        ):
            # Streamed, as a chat UI would: the tokens come back as server-sent events.
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                stream=True,
                extra_headers=tracing.inject_trace_context(),
                **openai_kwargs(params),
            )
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        tracing.shutdown_tracer()


def trace_serve(
    args: Namespace, engine_args: EngineArgs, params: SamplingParams, out: str, console: Console
) -> str:
    """Run the request through the server; returns the answer's text."""
    if args.raw:
        raise ValueError("--raw has no meaning with --serve: the server applies the chat template.")
    port = free_port()
    cmd = [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", "--port", str(port),
           "--trace-detail", args.detail, "--trace-dir", out, "--trace-live-views",
           "--served-model-name", "tracevllm", "--uvicorn-log-level", "warning",
           *engine_flags(engine_args)]  # fmt: skip
    with console.status("starting tracevllm serve (API server + engine core) ..."):
        server = ServerProcess(cmd, port)
    try:
        answer = traced_chat(server.url, "tracevllm", args.prompt, params, out)
    finally:
        # The server drains, shuts the engine down, and both flush their spans.
        server.stop()
    return answer
