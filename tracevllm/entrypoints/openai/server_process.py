"""A server in a child process: start it, wait until it answers, stop it.

tracevllm's own (vLLM's tests have ``RemoteOpenAIServer`` for the same job).
``tracevllm trace --serve``, ``make bench-serve`` and the server's tests all
drive a real server process through this, ``tracevllm serve`` or vLLM's own.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from typing import Any

import httpx


def free_port() -> int:
    """A TCP port nothing listens on now (127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``cmd`` (which must serve on ``port``) until ``stop()``; a context manager."""

    def __init__(
        self,
        cmd: list[str],
        port: int,
        env: dict[str, str] | None = None,
        timeout: float = 600,
        **popen_kwargs: Any,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, env=env, **popen_kwargs)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited during start-up ({self.proc.returncode})")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the server did not answer /health within {timeout:.0f} s")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (the server drains, then shuts its engine down); kill if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
