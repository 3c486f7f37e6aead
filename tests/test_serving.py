"""The OpenAI-compatible server, driven by the official ``openai`` client.

A real ``tracevllm serve`` process on 127.0.0.1 (its engine core in a third
process), the real client, sync and async. One server serves most tests;
a second one, with tracing on, serves the trace test and is then killed
from under its clients (its engine process gets SIGKILL).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest

from tracevllm import LLM, SamplingParams

pytestmark = pytest.mark.timeout(180)

API_KEY = "test-key"
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``tracevllm serve`` in a subprocess, up once /health answers."""

    def __init__(self, model_dir: str, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", model_dir,
             "--port", str(self.port), "--served-model-name", MODEL, "--api-key", API_KEY,
             "--num-gpu-blocks-override", "256", "--max-request-body-size", "100000",
             "--uvicorn-log-level", "warning", *extra],
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the server exited during start-up"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("the server did not come up")

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        values = {}
        for line in text.splitlines():
            if line.startswith("vllm:"):
                name_labels, value = line.rsplit(" ", 1)
                name = name_labels.split("{")[0]
                if 'finished_reason="' in name_labels:
                    name += ":" + name_labels.split('finished_reason="')[1].split('"')[0]
                values[name] = float(value)
        return values

    def engine_pid(self) -> int:
        (child,) = [
            p
            for p in psutil.Process(self.proc.pid).children()
            if "resource_tracker" not in " ".join(p.cmdline())
        ]
        return int(child.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[Server]:
    s = Server(tiny_model_dir)
    children = {p.pid for p in psutil.Process(s.proc.pid).children(recursive=True)}
    yield s
    assert s.stop() == 0
    # The engine process went with it.
    assert not any(psutil.pid_exists(pid) for pid in children if _alive(pid))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def greedy(**kw: Any) -> dict[str, Any]:
    return dict(model=MODEL, temperature=0.0, **kw)


# --- endpoints ------------------------------------------------------------------
def test_models_health_version(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_stream_equals_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(prompt="The capital of France is", max_tokens=12, **greedy(
        extra_body={"ignore_eos": True}))  # fmt: skip
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    stream = client.completions.create(
        prompt="The capital of France is",
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **greedy(extra_body={"ignore_eos": True}),
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert text == choice.text and finish == "length"
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()


def test_completion_usage_and_prompt_forms(server: Server, client: openai.OpenAI) -> None:
    prompt = "Hello there, how are you?"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    out = client.completions.create(prompt=prompt, max_tokens=5, **greedy(
        extra_body={"ignore_eos": True}))  # fmt: skip
    assert out.usage.prompt_tokens == len(tokens) and out.usage.completion_tokens == 5
    assert out.usage.total_tokens == len(tokens) + 5
    # The same prompt as token ids gives the same text; a batch of two gives two choices.
    as_ids = client.completions.create(prompt=tokens, max_tokens=5, **greedy(
        extra_body={"ignore_eos": True}))  # fmt: skip
    assert as_ids.choices[0].text == out.choices[0].text
    batch = client.completions.create(prompt=[prompt, "Other"], max_tokens=3, **greedy())
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == out.choices[0].text[: len(batch.choices[0].text)]
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()
    assert detok["prompt"] == prompt


def test_n_seed_logprobs_echo_stop(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, seed=7,
        logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].text != out.choices[1].text  # each child its own seed
    for c in out.choices:
        lp = c.logprobs
        assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 6
        assert all(t <= 0 for t in lp.token_logprobs)
        assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset) and "".join(lp.tokens) == c.text
    again = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, seed=7,
        logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    echo = client.completions.create(prompt="Echo me", max_tokens=3, echo=True, **greedy())
    assert echo.choices[0].text.startswith("Echo me")
    plain = client.completions.create(prompt="Echo me", max_tokens=8, **greedy(
        extra_body={"ignore_eos": True}))  # fmt: skip
    stop = plain.choices[0].text[3:6]
    stopped = client.completions.create(prompt="Echo me", max_tokens=8, stop=[stop], **greedy())
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert stopped.choices[0].model_extra["stop_reason"] == stop


def test_chat_equals_llm_chat(tiny_model_dir: str, client: openai.OpenAI, tokenizer: Any) -> None:
    # The reference renders the template with HF's tokenizer itself, not
    # through tracevllm's chat path, so a broken template step would show.
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as llm:
        expected = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        expected = expected[0].outputs[0].text
        assert llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text == expected
    out = client.chat.completions.create(messages=MESSAGES, max_completion_tokens=16, **greedy())
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    stream = client.chat.completions.create(
        messages=MESSAGES, max_tokens=16, stream=True, stream_options={"include_usage": True},
        **greedy(),
    )  # fmt: skip
    roles, text, usage = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            roles += [choice.delta.role] if choice.delta.role else []
            text += choice.delta.content or ""
        usage = chunk.usage or usage
    assert roles == ["assistant"] and text == expected
    assert usage is not None and usage.completion_tokens == out.usage.completion_tokens


def test_chat_logprobs_and_extra_params(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        messages=MESSAGES, max_completion_tokens=5, logprobs=True, top_logprobs=2,
        **greedy(extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.1, "min_tokens": 5,
                             "repetition_penalty": 1.1}),
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 5 == out.usage.completion_tokens
    for position in content:
        assert [t.logprob for t in position.top_logprobs] == sorted(
            (t.logprob for t in position.top_logprobs), reverse=True
        )
        assert len(position.top_logprobs) == 2
        # Greedy: the sampled token is the most likely one.
        assert position.token == position.top_logprobs[0].token
    assert "".join(p.token for p in content) == out.choices[0].message.content


def test_async_client_and_32_concurrent_streams(server: Server) -> None:
    async def run() -> list[int]:
        client = server.async_client()

        async def one(i: int) -> int:
            stream = await client.completions.create(
                model=MODEL, prompt=f"Story {i}:", max_tokens=24, temperature=0.8, seed=i,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            assert usage is not None
            return int(usage.completion_tokens or 0)

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    assert asyncio.run(run()) == [24] * 32


def test_client_disconnect_aborts_and_frees_blocks(server: Server, client: openai.OpenAI) -> None:
    before = server.metrics()
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json=dict(model=MODEL, prompt="A very long story", max_tokens=480, stream=True,
                  ignore_eos=True),
        timeout=30,
    ) as response:  # fmt: skip
        for chunks, _ in enumerate(response.iter_lines(), 1):
            if chunks >= 6:
                break  # hang up mid-stream
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.2)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    # Aborted: it never ran to its 480 tokens (no "length" finish, far fewer tokens).
    assert m["vllm:request_success_total:length"] == before["vllm:request_success_total:length"]
    generated = m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 240, generated
    assert client.completions.create(prompt="ok", max_tokens=2, **greedy()).choices


def test_metrics_names(server: Server, client: openai.OpenAI) -> None:
    before = server.metrics()
    client.completions.create(prompt="count me", max_tokens=4, **greedy(
        extra_body={"ignore_eos": True}))  # fmt: skip
    after = server.metrics()
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
    ):  # fmt: skip
        assert name in after, name
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4
    assert after["vllm:e2e_request_latency_seconds_count"] == (
        before["vllm:e2e_request_latency_seconds_count"] + 1
    )
    assert after["vllm:inter_token_latency_seconds_count"] == (
        before["vllm:inter_token_latency_seconds_count"] + 3
    )


# --- errors -----------------------------------------------------------------------
ERRORS = [
    # (json body, status, param, words in the message)
    (dict(model=MODEL, prompt="x", temperature=-1.0), 400, "temperature", "non-negative"),
    (dict(model=MODEL, prompt="x", top_p=5), 400, "top_p", "(0, 1]"),
    (dict(model=MODEL, prompt="x", max_tokens="5"), 400, "max_tokens", "integer"),
    (dict(model=MODEL, prompt="x", max_tokens=True), 400, "max_tokens", "integer"),
    (dict(model=MODEL, prompt="x", n=0), 400, "n", "at least 1"),
    (dict(model=MODEL, prompt="x", logprobs=50), 400, "logprobs", "max allowed"),
    (dict(model=MODEL, prompt="x", stop_token_ids=[10**9]), 400, "stop_token_ids", "vocabulary"),
    (dict(model=MODEL, prompt="word " * 600), 400, "prompt", "maximum context length"),
    (dict(model=MODEL, prompt=[]), 400, "prompt", "empty"),
    (dict(model="no-such-model", prompt="x"), 404, "model", "does not exist"),
    (dict(prompt="x", stream="yes"), 400, "stream", "boolean"),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), ERRORS)
def test_errors_are_openai_error_objects(
    server: Server, client: openai.OpenAI, body: dict[str, Any], status: int, param: str,
    words: str,
) -> None:  # fmt: skip
    response = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param, error
    assert words in error["message"], error
    assert client.completions.create(prompt="still there?", max_tokens=2, **greedy()).choices


def test_errors_through_the_official_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=[{"role": "user"}], **greedy())
    assert e.value.status_code == 400 and "content" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(messages=MESSAGES, model="nope")
    with pytest.raises(openai.BadRequestError, match="min_p"):
        client.chat.completions.create(messages=MESSAGES, **greedy(extra_body={"min_p": 2.0}))


def test_http_level_errors(server: Server, client: openai.OpenAI) -> None:
    url, auth = f"{server.url}/v1/completions", {"Authorization": f"Bearer {API_KEY}"}
    bad_json = httpx.post(url, content=b"{not json", headers={**auth, "Content-Type":
                          "application/json"})  # fmt: skip
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    no_key = httpx.post(url, json=dict(model=MODEL, prompt="x"))
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "AuthenticationError"
    wrong_key = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong_key.status_code == 401
    big = httpx.post(url, json=dict(model=MODEL, prompt="x" * 200_000), headers=auth)
    assert big.status_code == 413 and big.json()["error"]["code"] == 413
    not_json = httpx.post(url, content=b"prompt=x", headers=auth)
    assert not_json.status_code == 415
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert client.completions.create(prompt="after all that", max_tokens=2, **greedy()).choices


# --- tracing across three processes, then the engine's death ----------------------
@pytest.fixture(scope="module")
def traced_server(tiny_model_dir: str) -> Iterator[tuple[Server, Any]]:
    from tests.utils import OTLPCollector

    with OTLPCollector() as collector:
        s = Server(tiny_model_dir, "--otlp-traces-endpoint", collector.endpoint)
        try:
            yield s, collector
        finally:
            s.stop()


def test_one_trace_from_the_client_to_the_engine_core(traced_server: tuple[Server, Any]) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracevllm.tracing import inject_trace_context

    server, collector = traced_server
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test-client").start_as_current_span("client.chat") as span:
        from opentelemetry import trace

        headers = inject_trace_context(trace.set_span_in_context(span))
        # Streamed: the generation runs in the response's task, after the
        # handler returned, so only the trace headers can tie it in.
        stream = server.client().chat.completions.create(
            messages=MESSAGES, max_tokens=4, extra_headers=headers, stream=True, **greedy()
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    trace_id = f"{span.get_span_context().trace_id:032x}"
    # The server's and the engine's batches reach the collector within a few seconds.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        ours = [s for s in collector.spans() if s["traceId"] == trace_id]
        kinds = {s["resource"].get("tracevllm.process_kind") for s in ours}
        if {"frontend", "engine_core"} <= kinds and any(
            s["name"] == "EngineCore.step" for s in ours
        ):
            break
        time.sleep(0.3)
    pids = {s["resource"]["process.pid"] for s in ours} | {os.getpid()}
    assert len(pids) == 3, pids  # client, API server, engine core
    by_id = {s["spanId"]: s for s in ours}
    names = {s["name"] for s in ours}
    assert {
        "OpenAIServingChat.create_chat_completion",
        "AsyncLLM.generate",
        "llm_request",
        "EngineCore.add_request",
        "EngineCore.step",
    } <= names, names
    handler = next(s for s in ours if s["name"] == "OpenAIServingChat.create_chat_completion")
    assert handler["parentSpanId"] == f"{span.get_span_context().span_id:016x}"
    core_add = next(s for s in ours if s["name"] == "EngineCore.add_request")
    parent = by_id[core_add["parentSpanId"]]
    assert parent["name"] == "llm_request" and parent["resource"]["tracevllm.process_kind"] == (
        "frontend"
    )


def test_engine_death_while_streaming(traced_server: tuple[Server, Any]) -> None:
    """SIGKILL of the engine core under an open stream: the client gets an
    error within seconds, /health says 503, and the server exits non-zero."""
    server, _ = traced_server
    stream = server.client(timeout=30).completions.create(
        model=MODEL, prompt="Tell me a long story", max_tokens=400, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    os.kill(server.engine_pid(), signal.SIGKILL)
    t0 = time.monotonic()
    texts = []
    with pytest.raises((openai.APIError, httpx.HTTPError)):  # noqa: PT012
        for chunk in stream:
            texts.append(chunk.choices[0].text if chunk.choices else "")
        raise AssertionError("the stream ended as if nothing happened")
    assert time.monotonic() - t0 < 10
    health = [httpx.get(f"{server.url}/health").status_code for _ in range(1)]
    assert health == [503]
    assert server.proc.wait(timeout=20) == 1
