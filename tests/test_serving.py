"""The OpenAI-compatible server, driven by the official ``openai`` client.

A real ``tracevllm serve`` process on 127.0.0.1 (its engine core in a third
process), the real client, sync and async. One server serves most tests;
a second one, with tracing on, serves the trace test and is then killed
from under its clients (its engine process gets SIGKILL).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
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
from tracevllm.entrypoints.openai.server_process import ServerProcess, free_port

pytestmark = pytest.mark.timeout(180)

API_KEY = "test-key"
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


class Server(ServerProcess):
    """``tracevllm serve`` on the tiny model, up once /health answers."""

    def __init__(self, model_dir: str, *extra: str, **popen_kwargs: Any) -> None:
        port = free_port()
        super().__init__(
            [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", model_dir,
             "--port", str(port), "--served-model-name", MODEL, "--api-key", API_KEY,
             "--num-gpu-blocks-override", "256", "--max-request-body-size", "100000",
             "--uvicorn-log-level", "warning", *extra],
            port,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
            timeout=120,
            **popen_kwargs,
        )  # fmt: skip

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


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[Server]:
    s = Server(tiny_model_dir, "--trust-request-chat-template")
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


def test_a_port_in_use_is_refused_before_the_engine_starts(
    tiny_model_dir: str, server: Server
) -> None:
    # The port is bound before the engine starts (vLLM's setup_server), so a
    # port chosen free cannot be taken by another connection during start-up;
    # one already taken is an error at once, with no engine started.
    result = subprocess.run(
        [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", tiny_model_dir,
         "--port", str(server.port)],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot bind 127.0.0.1:{server.port} (Address already in use)" in result.stderr
    assert "pick another with --port" in result.stderr
    assert "EngineCore" not in result.stderr and "Traceback" not in result.stderr


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


def test_bench_serve_measures_what_it_says(server: Server, tmp_path: Any) -> None:
    """`tracevllm bench serve` (not a timed test: its figures are only checked
    for consistency with what was asked and with the server's own counters)."""
    from tracevllm.entrypoints.cli import main

    before = server.metrics()
    rc = main(["bench", "serve", "--base-url", server.url, "--model", MODEL, "--api-key",
               API_KEY, "--num-prompts", "6", "--max-concurrency", "3", "--output-len", "5",
               "--save-result", "--result-dir", str(tmp_path), "--label", "t"])  # fmt: skip
    assert rc == 0
    result = json.loads((tmp_path / "bench-serve-t.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 30
    after = server.metrics()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 30
    assert (
        after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
        == (result["total_input_tokens"])
    )
    assert 0 < result["p50_ttft_ms"] <= result["p99_ttft_ms"] <= result["p99_e2el_ms"]
    assert result["output_throughput"] == pytest.approx(30 / result["duration"])


def test_streamed_completion_logprobs(client: openai.OpenAI) -> None:
    whole = client.completions.create(prompt="Once", max_tokens=6, logprobs=2, **greedy(
        extra_body={"ignore_eos": True}))  # fmt: skip
    stream = client.completions.create(prompt="Once", max_tokens=6, logprobs=2, stream=True,
                                       **greedy(extra_body={"ignore_eos": True}))  # fmt: skip
    tokens, logprobs, offsets = [], [], []
    for chunk in stream:
        assert chunk.object == "text_completion" and chunk.created > 0
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            logprobs += lp.token_logprobs
            offsets += lp.text_offset
    expected = whole.choices[0].logprobs
    assert tokens == expected.tokens and len(tokens) == 6
    assert logprobs == pytest.approx(expected.token_logprobs)
    assert offsets == expected.text_offset


def test_structured_outputs_over_http(client: openai.OpenAI) -> None:
    import jsonschema

    # Enums and booleans: a tiny random model could write a string forever.
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": "A color, as JSON."}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        # vLLM's extra body: response_format's schema replaces a json of its
        # own (vLLM's rule), the options stay: no free whitespace, xgrammar's
        # one-line separators (", " and ": ", json.dumps's).
        **greedy(extra_body={"structured_outputs": {"json": {"type": "string"},
                                                    "disable_any_whitespace": True}}),
    )  # fmt: skip
    content = out.choices[0].message.content
    jsonschema.validate(json.loads(content), schema)
    assert content == json.dumps(json.loads(content)), content
    choice = client.completions.create(prompt="Pick:", max_tokens=10, **greedy(
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}}))  # fmt: skip
    assert choice.choices[0].text in {"red", "green", "blue"}
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        client.completions.create(prompt="x", **greedy(
            extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}))  # fmt: skip


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    ("response_format", "structured_outputs", "words"),
    [
        ({"type": "json_object"}, {"regex": "a+"},
         "'json_object' and structured_outputs sets 'regex'"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}},
         {"choice": ["a", "b"]}, "'json' and structured_outputs sets 'choice'"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}},
         {"json_object": True}, "'json' and structured_outputs sets 'json_object'"),
        ({"type": "json_object"}, {"json": {"type": "object"}}, "structured_outputs sets 'json'"),
        # Options without a constraint of their own: refused, as vLLM's model refuses them.
        ({"type": "json_object"}, {"disable_any_whitespace": True}, "one kind of constraint"),
    ],
)  # fmt: skip
def test_response_format_beside_structured_outputs_is_a_400(
    client: openai.OpenAI, endpoint: str, response_format: dict[str, Any],
    structured_outputs: dict[str, Any], words: str,
) -> None:  # fmt: skip
    """vLLM 0.22.0: response_format's constraint replaces structured_outputs'
    one of the same kind; a constraint of another kind is a 400 (the
    StructuredOutputsParams it would make holds two kinds)."""
    extra_body = {"structured_outputs": structured_outputs}
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(
                messages=MESSAGES,
                response_format=response_format,
                **greedy(max_tokens=4, extra_body=extra_body),
            )
        else:  # the client's completions.create has no response_format: vLLM takes it
            client.completions.create(prompt="x", **greedy(max_tokens=4, extra_body={
                **extra_body, "response_format": response_format}))  # fmt: skip
    assert e.value.status_code == 400 and words in e.value.body["message"], e.value.body
    if "one kind of constraint" not in words:
        assert (
            "You can only use one kind of structured outputs constraint" in e.value.body["message"]
        )
    # Either alone is served.
    assert client.completions.create(prompt="x", **greedy(max_tokens=4, extra_body={
        "response_format": response_format})).choices  # fmt: skip


def test_completion_details_as_vllm(server: Server, client: openai.OpenAI) -> None:
    # logprobs=0: the sampled token's logprob alone, in a one-entry dict.
    zero = client.completions.create(prompt="Hi", max_tokens=2, logprobs=0, **greedy())
    assert [len(top) for top in zero.choices[0].logprobs.top_logprobs] == [1, 1]
    # echo with a prompt of token ids: the prompt's text comes back too.
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Echo this"}).json()["tokens"]
    echo = client.completions.create(prompt=ids, max_tokens=2, echo=True, **greedy())
    assert echo.choices[0].text.startswith("Echo this")


def test_non_streamed_disconnect_aborts(server: Server, client: openai.OpenAI) -> None:
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json=dict(model=MODEL, prompt="Long", max_tokens=480, ignore_eos=True),
            timeout=0.3,  # hang up while it runs
        )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.2)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:request_success_total:length"] == before["vllm:request_success_total:length"]


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
    (dict(model=MODEL, prompt=[5] * 512), 400, "prompt", "leaves no room"),
    (
        dict(model=MODEL, prompt="x", stream_options={"include_usage": True}),
        400,
        "stream_options",
        "stream=True",
    ),
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
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=MESSAGES, top_logprobs=2, **greedy())
    assert e.value.body["param"] == "top_logprobs"
    for template in ("{{ raise_exception('boom') }}", "{% if %}", "{{ undefined_x.y }}"):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                messages=MESSAGES, **greedy(extra_body={"chat_template": template})
            )


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
    body = json.dumps(dict(model=MODEL, prompt="x" * 200_000)).encode()
    chunked = httpx.post(  # no Content-Length: the limit must still hold
        url, content=iter([body[i : i + 4096] for i in range(0, len(body), 4096)]),
        headers={**auth, "Content-Type": "application/json"},
    )  # fmt: skip
    assert chunked.status_code == 413, chunked.text
    not_json = httpx.post(url, content=b"prompt=x", headers=auth)
    assert not_json.status_code == 415
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert client.completions.create(prompt="after all that", max_tokens=2, **greedy()).choices


def test_trace_serve_writes_one_trace_over_three_processes(
    tiny_model_dir: str, tmp_path: Any
) -> None:
    """`tracevllm trace --serve` (make trace-serve): the four files, one trace, three pids."""
    from tracevllm.tracing.exporters import read_spans_jsonl

    result = subprocess.run(
        [sys.executable, "-m", "tracevllm.entrypoints.cli", "trace", "--serve", "--prompt", "Hi",
         "--model", tiny_model_dir, "--max-tokens", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=170, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("spans.jsonl", "trace.perfetto.json", "views.svg", "views.html"):
        assert (tmp_path / name).stat().st_size > 0, name
    spans = read_spans_jsonl(str(tmp_path / "spans.jsonl"))
    assert len({s.trace_id for s in spans}) == 1
    assert {s.process_kind for s in spans} == {"client", "frontend", "engine_core"}
    assert len({s.pid for s in spans}) == 3
    assert "CL HTTP client" in result.stdout and "⇄" in result.stdout


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


def test_request_chat_templates_need_trust(traced_server: tuple[Server, Any]) -> None:
    """A template sent with a request runs on the server: refused unless the
    server was started with --trust-request-chat-template (vLLM's rule)."""
    server, _ = traced_server
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            messages=MESSAGES, **greedy(extra_body={"chat_template": "{{ 'x' }}"})
        )
    assert e.value.body["param"] == "chat_template"
    r = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES, "chat_template": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


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
    # /health turns 503 at once (the watchdog stops the server seconds later).
    while httpx.get(f"{server.url}/health").status_code != 503:
        assert time.monotonic() - t0 < 5, "/health still says 200"
        time.sleep(0.05)
    texts = []
    with pytest.raises((openai.APIError, httpx.HTTPError)):  # noqa: PT012
        for chunk in stream:
            texts.append(chunk.choices[0].text if chunk.choices else "")
        raise AssertionError("the stream ended as if nothing happened")
    assert time.monotonic() - t0 < 10
    assert server.proc.wait(timeout=20) == 1
