"""The disaggregation proxy (``tracevllm disagg-proxy``) between live servers.

Two prefill servers (``kv_producer``) and a decode server (``kv_consumer``),
``tracevllm serve`` with ``ExampleConnector`` over one folder and tracing on,
and the proxy in front of them, all started once for the module. Through
the proxy, the official ``openai`` client gets a single server's greedy
answer, streamed and not, for completions and chat; the prefill servers take
turns and answer one token each; the decode server loads the prompt instead
of computing it; a backend that is down, or that refuses the request, is an
OpenAI error object with the right status; a client that hangs up mid-stream
aborts the request on the decode server; and one request's trace holds the
spans of the client, the proxy, the prefill server and its engine core, the
decode server and its engine core. The proxy's handling of a client's own
``kv_transfer_params`` is tested in this process, against stub backends.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from rich.console import Console

from tests.utils import make_tiny_llama
from tracevllm.entrypoints.openai.server_process import ServerProcess, free_port
from tracevllm.entrypoints.serve.disagg.proxy import (
    PREFILL_KV_TRANSFER_PARAMS,
    DisaggProxy,
    build_app,
)
from tracevllm.entrypoints.trace_disagg import (
    MODEL,
    proxy_command,
    serve_command,
    start_servers,
)
from tracevllm.entrypoints.trace_serve import traced_chat
from tracevllm.sampling_params import SamplingParams
from tracevllm.tracing import SPANS_FILE
from tracevllm.tracing.exporters import SpanRecord, read_spans_jsonl
from tracevllm.views.waterfall import render_waterfall

# Three servers start at once; on a busy machine that takes minutes.
pytestmark = pytest.mark.timeout(900)

PROMPT = list(range(40, 81))  # 41 tokens: 40 kept (5 blocks of 8), 1 computed


def prompt(seed: int) -> list[int]:
    """41 tokens of their own (the decode server's prefix cache has not seen them)."""
    return random.Random(seed).sample(range(3, 400), len(PROMPT))


MESSAGES = [{"role": "user", "content": "Where do the keys and values of a prompt go?"}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@dataclass
class Cluster:
    prefill: list[ServerProcess]
    decode: ServerProcess
    proxy: ServerProcess
    trace_dir: str

    def client(self, server: ServerProcess | None = None) -> openai.OpenAI:
        url = (server or self.proxy).url
        return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


class UnhealthyProxy(ServerProcess):
    """A proxy in front of a backend that is down: its /health is a 503, so
    it counts as started once it answers at all."""

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the proxy exited during start-up ({self.proc.returncode})")
            try:
                httpx.get(f"{self.url}/health", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise TimeoutError("the proxy did not answer")


def start_proxy(prefill: list[str], decode: list[str], trace_dir: str) -> ServerProcess:
    port = free_port()
    cls = ServerProcess if all(u != DOWN for u in prefill + decode) else UnhealthyProxy
    return cls(proxy_command(port, prefill, decode, "request", trace_dir), port)


# A port held (bound, never listening) for the whole run: a connection to it
# is refused, and no server started here can take it.
_held = socket.socket()
_held.bind(("127.0.0.1", 0))
DOWN = f"http://127.0.0.1:{_held.getsockname()[1]}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model_dir = make_tiny_llama(
        str(tmp_path_factory.mktemp("disagg-llama")), seed=0, initializer_range=0.08
    )
    store = str(tmp_path_factory.mktemp("disagg-store"))
    trace_dir = str(tmp_path_factory.mktemp("disagg-trace"))
    flags = [model_dir, "--block-size", "8", "--num-gpu-blocks-override", "64"]
    ports = [free_port() for _ in range(3)]
    roles = ("kv_producer", "kv_producer", "kv_consumer")
    servers = start_servers(
        [
            (serve_command(role, port, store, "request", trace_dir, flags), port)
            for role, port in zip(roles, ports)
        ]
    )
    try:
        proxy = start_proxy([s.url for s in servers[:2]], [servers[2].url], trace_dir)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    yield Cluster(servers[:2], servers[2], proxy, trace_dir)
    assert proxy.stop() == 0
    for server in servers:
        assert server.stop() == 0


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """The sum of a Prometheus series over the label values not given."""
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics", timeout=60).text.splitlines():
        m = re.match(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def counts(cluster: Cluster) -> list[float]:
    """Requests finished, and tokens generated, on each prefill server; and
    the decode server's prompt tokens that came through the connector."""
    return [
        *(metric(s, "vllm:request_success_total") for s in cluster.prefill),
        *(metric(s, "vllm:generation_tokens_total") for s in cluster.prefill),
        metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_through_the_proxy_is_one_servers_answer(cluster: Cluster, stream: bool) -> None:
    """Mutation caught: the prefill request not cut to max_tokens=1 (the
    prefill server then generates all 12 tokens)."""
    tokens = prompt(int(stream))
    single = cluster.client(cluster.prefill[0]).completions.create(
        model=MODEL, prompt=tokens, max_tokens=12, **GREEDY
    )
    before = counts(cluster)
    if stream:
        chunks = cluster.client().completions.create(
            model=MODEL, prompt=tokens, max_tokens=12, stream=True, **GREEDY
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        answer = cluster.client().completions.create(
            model=MODEL, prompt=tokens, max_tokens=12, **GREEDY
        )
        text = answer.choices[0].text
        assert answer.usage is not None and answer.usage.completion_tokens == 12
    assert text == single.choices[0].text
    done = [b - a for a, b in zip(before, counts(cluster))]
    # One prefill server answered one request with one token.
    assert sorted(done[:2]) == [0, 1] and sum(done[2:4]) == 1
    # The decode server loaded the prompt's 5 kept blocks.
    assert done[4] == 40


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_through_the_proxy_is_one_servers_answer(cluster: Cluster, stream: bool) -> None:
    """Mutation caught: max_tokens and max_completion_tokens left uncut."""
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=10, **GREEDY)
    single = cluster.client(cluster.prefill[0]).chat.completions.create(**kwargs)  # type: ignore[call-overload]
    before = counts(cluster)
    if stream:
        chunks = cluster.client().chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        answer = cluster.client().chat.completions.create(**kwargs)  # type: ignore[call-overload]
        text = answer.choices[0].message.content
    assert text == single.choices[0].message.content
    done = [b - a for a, b in zip(before, counts(cluster))]
    # max_completion_tokens too was cut to 1 for the prefill server.
    assert sum(done[2:4]) == 1


def test_prefill_servers_take_turns(cluster: Cluster) -> None:
    """Mutation caught: ``schedule`` always the first instance."""
    before = counts(cluster)
    for _ in range(4):
        cluster.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **GREEDY)
    done = [b - a for a, b in zip(before, counts(cluster))]
    assert done[:2] == [2, 2]


@pytest.mark.parametrize("down", ["prefill", "decode"])
def test_a_backend_that_is_down_is_a_502_error_object(cluster: Cluster, down: str) -> None:
    """Mutation caught: a connection error let through (a bare 500)."""
    up = cluster.decode.url if down == "prefill" else cluster.prefill[0].url
    prefill, decode = ([DOWN], [up]) if down == "prefill" else ([up], [DOWN])
    with start_proxy(prefill, decode, cluster.trace_dir) as proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=stream)
            assert e.value.status_code == 502
            error = e.value.body
            assert isinstance(error, dict) and error["type"] == "BadGatewayError"
            assert error["code"] == 502 and DOWN in error["message"]
        health = httpx.get(f"{proxy.url}/health")
        assert health.status_code == 503 and DOWN in health.json()["error"]["message"]


def test_a_backends_refusal_is_its_own_error_object(cluster: Cluster) -> None:
    """Mutation caught: the backend's status not kept (a 200 or a 500)."""
    with pytest.raises(openai.NotFoundError) as e:
        cluster.client().completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert isinstance(e.value.body, dict) and "no-such-model" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        cluster.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=2, stream=True, top_p=7.0
        )
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{cluster.proxy.url}/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_hangs_up_aborts_the_decode(cluster: Cluster, stream: bool) -> None:
    """The client's connection closes while the decode server generates: the
    request is aborted there. Mutations caught: the handler not cancelled
    when its client goes (no ``with_cancellation``: whole), the relay shielded
    from the cancellation (streamed); either request then runs to its length."""
    aborted = metric(cluster.decode, "vllm:request_success_total", finished_reason="abort")
    body = json.dumps(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
         "stream": stream, "temperature": 0.0}
    ).encode()  # fmt: skip
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", cluster.proxy.port)) as conn:
        conn.sendall(head.encode() + body)
        # Hang up once the decode server is generating.
        deadline = time.monotonic() + 120
        while metric(cluster.decode, "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the request never reached the decode server"
            time.sleep(0.05)
    deadline = time.monotonic() + 60
    while metric(cluster.decode, "vllm:request_success_total", finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, "the decode server never aborted the request"
        time.sleep(0.2)


def test_the_clients_own_kv_transfer_params_never_reach_the_decode_server() -> None:
    """A client's kv_transfer_params name blocks and a host for the decode
    server to read; the proxy sends on only the prefill server's. The proxy
    runs in this process, its backends a stub that keeps each body (no server
    started): when the prefill server answers with no params, the decode
    server gets none; when it answers with some, exactly those; the prefill
    server gets the proxy's own. Mutation caught: the client's params not
    dropped (the decode server gets the hostile ones)."""
    hostile = {
        "do_remote_prefill": True,
        "remote_engine_id": "elsewhere",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [0, 1, 2],
    }
    received: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    prefill_answers: list[dict[str, Any] | None] = [None, {"do_remote_prefill": True}]

    def backend(request: httpx.Request) -> httpx.Response:
        role = request.url.host
        received[role].append(json.loads(request.content))
        answer: dict[str, Any] = {"choices": [{"index": 0, "text": role}]}
        if role == "prefill" and (params := prefill_answers[(len(received[role]) - 1) % 2]):
            answer["kv_transfer_params"] = params
        return httpx.Response(200, json=answer)

    proxy = DisaggProxy(["http://prefill"], ["http://decode"])

    async def run() -> None:
        proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(backend))
        app = httpx.ASGITransport(app=build_app(proxy))
        async with httpx.AsyncClient(transport=app, base_url="http://proxy") as client:
            for endpoint, body in (
                ("/v1/completions", {"prompt": PROMPT}),
                ("/v1/chat/completions", {"messages": MESSAGES}),
            ):
                for _ in prefill_answers:
                    request = {"model": MODEL, "max_tokens": 4, "kv_transfer_params": hostile}
                    answer = await client.post(endpoint, json=request | body)
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["choices"][0]["text"] == "decode"
        await proxy.client.aclose()

    asyncio.run(run())
    assert [r["kv_transfer_params"] for r in received["prefill"]] == [
        PREFILL_KV_TRANSFER_PARAMS
    ] * 4
    assert [r.get("kv_transfer_params") for r in received["decode"]] == prefill_answers * 2
    assert [r["max_tokens"] for r in received["decode"]] == [4] * 4


def _trace(path: str, trace_id: str) -> list[SpanRecord]:
    return [s for s in read_spans_jsonl(path) if s.trace_id == trace_id]


def test_one_trace_over_client_proxy_and_both_servers_and_their_cores(cluster: Cluster) -> None:
    """Mutations caught: no traceparent to the backends (the servers' spans in
    traces of their own), kv_transfer_params not passed on (the decode
    server's request not the prefill server's child), the proxy's process
    kind unknown to the waterfall (shown as ``?``), the narrow waterfall's
    legend keeping one pid of a kind."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    answer = traced_chat(cluster.proxy.url, MODEL, "What is a KV cache?", params, cluster.trace_dir)
    assert answer
    path = os.path.join(cluster.trace_dir, SPANS_FILE)
    (client,) = [
        s for s in read_spans_jsonl(path) if s.process_kind == "client" and s.pid == os.getpid()
    ]
    prefill_pids = {s.proc.pid for s in cluster.prefill}
    decode_pid = cluster.decode.proc.pid
    # Each process's spans reach the file within its batch processor's delay,
    # in no fixed order: wait for every process the request went through.
    deadline = time.monotonic() + 120
    while True:
        spans = _trace(path, client.trace_id)
        kinds: dict[str, set[int]] = {}
        for s in spans:
            kinds.setdefault(s.process_kind, set()).add(s.pid)
        names = [s.name for s in spans]
        arrived = (
            all(
                len(kinds.get(k, ())) == n
                for k, n in (("proxy", 1), ("frontend", 2), ("engine_core", 2))
            )
            and {"DisaggProxy.create_chat_completion", "DisaggProxy.prefill", "DisaggProxy.decode"}
            <= set(names)
            and names.count("llm_request") >= 2
        )
        if arrived or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert kinds.get("proxy") == {cluster.proxy.proc.pid}
    frontends = kinds.get("frontend", set())
    assert len(frontends & prefill_pids) == 1 and decode_pid in frontends, kinds
    assert len(kinds.get("engine_core", ())) == 2, kinds
    by_id = {s.span_id: s for s in spans}
    (request,) = [s for s in spans if s.name == "DisaggProxy.create_chat_completion"]
    assert request.parent_span_id == client.span_id
    calls = {s.name: s for s in spans if s.parent_span_id == request.span_id}
    assert set(calls) == {"DisaggProxy.prefill", "DisaggProxy.decode"}
    # Each server's handler is the child of the proxy's call to it.
    for call, pids in (("prefill", prefill_pids), ("decode", {decode_pid})):
        (handler,) = [s for s in spans if s.parent_span_id == calls[f"DisaggProxy.{call}"].span_id]
        assert handler.pid in pids
    # The decode server's request continues the prefill server's.
    (decoded,) = [s for s in spans if s.name == "llm_request" and s.pid == decode_pid]
    assert decoded.parent_span_id is not None
    assert by_id[decoded.parent_span_id].pid in prefill_pids
    # The waterfall names the proxy's process.
    assert re.search(r"DisaggProxy\.create_chat_completion +PX\b", waterfall_text(spans))
    # In a narrow terminal the pids go to the legend: both servers', both cores'.
    narrow = waterfall_text(spans, width=80)
    assert all(str(pid) in narrow for pid in frontends | kinds["engine_core"])


def waterfall_text(spans: list[SpanRecord], width: int = 200) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render_waterfall(spans))
    return console.export_text()
