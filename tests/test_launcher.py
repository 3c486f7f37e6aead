"""The server's socket and uvicorn around it (entrypoints/launcher.py,
``create_server_socket``): a real uvicorn on 127.0.0.1, no engine."""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from tracevllm.entrypoints.launcher import _Server
from tracevllm.entrypoints.openai.api_server import BindError, create_server_socket

pytestmark = pytest.mark.timeout(60)


def test_a_server_on_a_given_socket_says_where_it_listens(capfd: Any) -> None:
    """uvicorn logs "Uvicorn running on ..." only for a socket it binds
    itself; the server binds its own before the engine starts, and still
    says where it listens (the README's start-up line). Mutation caught:
    uvicorn.Server instead of _Server (no line)."""
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"ok": "yes"}

    with create_server_socket(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
        server = _Server(uvicorn.Config(app, log_level="info"))

        async def run() -> dict[str, str]:
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started:
                assert not serving.done(), serving.exception()
                await asyncio.sleep(0.01)
            try:
                async with httpx.AsyncClient() as client:
                    return (await client.get(f"http://127.0.0.1:{port}/ping")).json()
            finally:
                server.should_exit = True
                await serving

        assert asyncio.run(run()) == {"ok": "yes"}
    assert (
        f"Uvicorn running on http://127.0.0.1:{port} (Press CTRL+C to quit)"
        in capfd.readouterr().err
    )


def test_bind_errors_name_the_flag_to_change() -> None:
    """In use: --port; an address not this machine's or a host that does not
    resolve: --host. Each a BindError (tracevllm serve exits 2 with it)."""
    with create_server_socket(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        taken.listen()
        with pytest.raises(BindError, match="pick another with --port") as e:
            create_server_socket(("127.0.0.1", port))
        assert e.value.errno == errno.EADDRINUSE
    with pytest.raises(BindError, match=r"\(Cannot assign requested address\): check --host"):
        create_server_socket(("192.0.2.1", 0))  # TEST-NET-1: never this machine's
    with pytest.raises(BindError, match="cannot resolve --host 'no.such.host.invalid'"):
        create_server_socket(("no.such.host.invalid", 0))


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_ipv6_hosts_with_or_without_brackets() -> None:
    for host in ("::1", "[::1]"):
        try:
            sock = create_server_socket((host, 0))
        except BindError as e:  # an IPv6 stack without a loopback address
            pytest.skip(str(e))
        with sock:
            assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"
