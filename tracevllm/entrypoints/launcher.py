"""uvicorn under the app, and the server's guard against slow clients.

Mirrors vllm/entrypoints/launcher.py (``serve_http``, ``watchdog_loop``):
uvicorn with vLLM's limits (``timeout_keep_alive`` from
``TRACEVLLM_HTTP_TIMEOUT_KEEP_ALIVE``, ``--h11-max-incomplete-event-size``),
and a watchdog that stops the server once the engine is dead. Left out: SSL
and its certificate refresher, vLLM's own SIGTERM handler (uvicorn's drains
the connections), ``--h11-max-header-count`` (uvicorn 0.54 never reads it,
so it limits nothing in vLLM either).

tracevllm's own: ``GuardedH11Protocol``. uvicorn times a connection out only
while it is idle between two requests; one that opens and sends half a request
line (or trickles its headers or body, "slowloris") holds its file
descriptor for as long as it likes, and ~20,000 of them stop the server from
accepting anyone (``accept()`` fails with EMFILE). So each connection here has
``--request-read-timeout`` seconds to send a whole request, and once the server
holds as many connections as it has descriptors to spare (or
``--limit-concurrency`` - 1), a new one closes the oldest that is still
sending its request: a flood of half-sent requests cannot keep a well-behaved
client out, and each of them is gone after the timeout.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from tracevllm.entrypoints.openai.cli_args import H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT
from tracevllm.logger import init_logger

if TYPE_CHECKING:
    from tracevllm.engine.async_llm import AsyncLLM

logger = init_logger(__name__)

# How often the watchdog looks at the engine (vLLM: VLLM_WATCHDOG_TIME_S).
WATCHDOG_TIME_S = 5.0
# File descriptors kept for everything but connections (log files, the
# tokenizer's files, ZeroMQ's reconnects).
FD_RESERVE = 64
# The least time between two warnings about slow clients (a flood would
# otherwise write a line per connection).
WARNING_INTERVAL_S = 10.0


@dataclass
class ConnectionGuard:
    """One server's connections that are still sending a request, oldest first."""

    read_timeout: float
    max_connections: int
    pending: dict[GuardedH11Protocol, None] = field(default_factory=dict)
    last_warning: dict[str, float] = field(default_factory=dict)

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self.last_warning.get(kind, -WARNING_INTERVAL_S) >= WARNING_INTERVAL_S:
            self.last_warning[kind] = now
            logger.warning(message, *args)


# --8<-- [start:guarded_h11_protocol]
class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request to arrive in
    full, and room made for new connections by closing the oldest pending one.

    The deadline runs from the connection's opening (or from the end of the
    previous response on a kept-alive connection) until h11 has the whole
    request, headers and body; a request being served has none.
    """

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.arm_read_deadline()
        if len(self.connections) > self.guard.max_connections:
            self.close_oldest_pending()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm_read_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self.disarm_read_deadline()  # the request is in: no deadline while it is served

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self.arm_read_deadline()  # the next request on this connection
        super().on_response_complete()

    def arm_read_deadline(self) -> None:
        self.disarm_read_deadline()
        self.read_deadline = self.loop.call_later(self.guard.read_timeout, self.read_timed_out)
        self.guard.pending[self] = None

    def disarm_read_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None
        self.guard.pending.pop(self, None)

    def read_timed_out(self) -> None:
        self.guard.warn(
            "timeout",
            "Closing connections that did not send a whole request within %.0f s "
            "(--request-read-timeout).",
            self.guard.read_timeout,
        )
        self.close_pending()

    def close_oldest_pending(self) -> None:
        oldest = next((p for p in self.guard.pending if p is not self), None)
        if oldest is None:
            return  # every other connection is being served: nothing to close
        self.guard.warn(
            "full",
            "The server holds %d connections, its most: closing the oldest ones that are "
            "still sending their request, to make room for new ones.",
            self.guard.max_connections,
        )
        oldest.close_pending()

    def close_pending(self) -> None:
        # No response: h11 cannot answer a request it has not read; a handler
        # already reading the body sees the client disconnect.
        self.disarm_read_deadline()
        if not self.transport.is_closing():
            self.transport.close()


# --8<-- [end:guarded_h11_protocol]


def connection_budget(limit_concurrency: int | None) -> int:
    """How many connections the server may hold: the descriptors it has left,
    less a reserve; below ``limit_concurrency``, whose last slot uvicorn
    refuses (it answers 503 once connections >= the limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    budget = (
        2**31 if soft == resource.RLIM_INFINITY else soft - len(os.listdir(fd_dir)) - FD_RESERVE
    )
    if limit_concurrency is not None:
        budget = min(budget, limit_concurrency - 1)
    return max(budget, 1)


# --8<-- [start:serve_http]
async def serve_http(
    app: FastAPI,
    engine_client: AsyncLLM,
    *,
    sock: socket.socket | None = None,
    request_read_timeout: float,
    h11_max_incomplete_event_size: int | None = None,
    **uvicorn_kwargs: Any,
) -> None:
    """Serve ``app`` until a shutdown is asked for or the engine dies."""
    guard = ConnectionGuard(
        read_timeout=request_read_timeout,
        max_connections=connection_budget(uvicorn_kwargs.get("limit_concurrency")),
    )
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
    config = uvicorn.Config(
        app,
        http=protocol,
        h11_max_incomplete_event_size=h11_max_incomplete_event_size
        or H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT,
        **uvicorn_kwargs,
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    previous_handler = loop.get_exception_handler()
    loop.set_exception_handler(functools.partial(quiet_emfile, guard))
    watchdog = asyncio.create_task(watchdog_loop(server, engine_client))
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        watchdog.cancel()
        loop.set_exception_handler(previous_handler)


class _Server(uvicorn.Server):
    """uvicorn's server, which says where it listens on a socket given to it
    too (uvicorn does only for a socket it binds itself)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if sockets and self.started:
            host, port = sockets[0].getsockname()[:2]
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                f"[{host}]" if ":" in host else host,
                port,
            )


def quiet_emfile(
    guard: ConnectionGuard, loop: asyncio.AbstractEventLoop, context: dict[str, Any]
) -> None:
    """One warning, not thousands, when accept() runs out of descriptors.

    A burst of connections can use up the reserve before the guard closes
    any; asyncio then stops accepting for a second, but CPython 3.11's accept
    loop reports the error once per connection it still tries in that tick
    (up to the backlog, 2048), each with a traceback.
    """
    if context.get("message") == "socket.accept() out of system resource":
        guard.warn(
            "emfile",
            "Out of file descriptors (%s): not accepting connections for a second.",
            context.get("exception"),
        )
    else:
        loop.default_exception_handler(context)


async def watchdog_loop(server: uvicorn.Server, engine: AsyncLLM) -> None:
    """Stop the server once the engine is dead (vLLM: terminate_if_errored)."""
    while True:
        await asyncio.sleep(WATCHDOG_TIME_S)
        if engine.errored:
            logger.error("EngineCore is dead: shutting the server down.")
            server.should_exit = True
            return


# --8<-- [end:serve_http]
