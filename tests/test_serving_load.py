"""``tracevllm serve`` under a flood of slow clients (slowloris).

A real server on 127.0.0.1 whose open-file limit is lowered to ``NOFILE``
(soft and hard, so ``set_ulimit`` cannot lift it), flooded with more
connections than that, each sending part of a request and then nothing: the
same as ~21,000 of them against the usual limit, at a size a test can afford.
A well-behaved client (the official ``openai`` client) must be served while
the flood holds, and every slow connection must be closed once
``--request-read-timeout`` has passed.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest

from tracevllm.entrypoints.openai.server_process import ServerProcess, free_port

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny"
NOFILE = 256
FLOOD = 320
READ_TIMEOUT = 10.0


def _lower_nofile() -> None:  # in the server's process, before it starts
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(
        [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", tiny_model_dir,
         "--port", str(port), "--served-model-name", MODEL, "--num-gpu-blocks-override", "64",
         "--request-read-timeout", str(READ_TIMEOUT), "--uvicorn-log-level", "warning"],
        port,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        timeout=120,
        preexec_fn=_lower_nofile,
    ) as s:  # fmt: skip
        yield s


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (without reading from it)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def slow_clients(port: int) -> list[socket.socket]:
    """FLOOD connections, each stuck in its request: most have sent part of
    the request line or headers, some whole headers and part of the body,
    some a whole request, its response read, then part of the next one (a
    kept-alive connection, which uvicorn stops timing once data arrives)."""
    socks = []
    for i in range(FLOOD):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 10 == 1:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                      b"Content-Type: application/json\r\n\r\n{\"model\":")  # fmt: skip
        elif i % 10 == 2 and i < 40:  # the first few, while the server still accepts
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            s.sendall(b"GET /hea")
        else:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        socks.append(s)
    return socks


def test_a_flood_of_slow_clients_keeps_no_one_out(server: ServerProcess) -> None:
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="none", max_retries=2, timeout=READ_TIMEOUT / 2
    )
    socks = slow_clients(server.port)
    flood_start = time.monotonic()
    try:
        # (b) Served while the flood holds: well before any deadline.
        out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert out.choices[0].text and out.usage.completion_tokens == 4
        assert time.monotonic() - flood_start < READ_TIMEOUT / 2
        still_open = sum(not is_closed(s) for s in socks)
        assert still_open > 100, still_open  # the flood was still there
        # (a) Every slow connection is closed once its deadline has passed.
        deadline = flood_start + READ_TIMEOUT + 15
        while (open_now := sum(not is_closed(s) for s in socks)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert open_now == 0, f"{open_now} slow connections still open"
        assert time.monotonic() - flood_start >= READ_TIMEOUT * 0.9  # not before the timeout
        # And the server serves as before.
        out = client.completions.create(model=MODEL, prompt="Again", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2
    finally:
        for s in socks:
            s.close()


def test_set_ulimit_raises_the_soft_limit_to_the_hard_one() -> None:
    code = (
        "import resource\n"
        "from tracevllm.utils.system_utils import set_ulimit\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 512))\n"
        "set_ulimit()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "(512, 512)", out.stderr


def test_the_connection_budget_stays_below_limit_concurrency() -> None:
    from tracevllm.entrypoints.launcher import connection_budget

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_budget(None) < soft
    # uvicorn answers 503 once connections >= --limit-concurrency: one slot is kept for
    # the newest connection, whose request must pass that check.
    assert connection_budget(10) == 9
    assert connection_budget(1) == 1


def test_load_flags_are_checked() -> None:
    from tracevllm.entrypoints.cli import make_parser

    parser = make_parser()
    bad_flags = [
        ["--limit-concurrency", "0"],
        ["--request-read-timeout", "nan"],
        ["--request-read-timeout", "-1"],
        ["--h11-max-incomplete-event-size", "x"],
    ]
    for bad in bad_flags:
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])
    args = parser.parse_args(["serve"])
    assert (args.limit_concurrency, args.request_read_timeout) == (None, 30.0)
    assert args.h11_max_incomplete_event_size == 4 * 1024 * 1024  # vLLM's
