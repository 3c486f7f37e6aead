"""Every TRACEVLLM_* environment variable, in one place.

Mirrors vllm/envs.py: nothing else in the package reads ``os.environ``. Each
variable is read when asked for (module ``__getattr__``), so a test can set one
with ``monkeypatch.setenv`` and see it take effect.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any


def _count(name: str, default: str) -> Callable[[], int]:
    """A whole number >= 0; anything else is an error that names the variable."""

    def read() -> int:
        raw = os.environ.get(name, default)
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {raw!r}.")
        return value

    return read


def _bool(name: str, default: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


environment_variables: dict[str, Callable[[], Any]] = {
    # Run EngineCore in its own process behind ZeroMQ (vLLM's
    # VLLM_ENABLE_V1_MULTIPROCESSING). 0 keeps it in the caller's process,
    # for breakpoints and pdb.
    "TRACEVLLM_ENABLE_MULTIPROCESSING": _bool("TRACEVLLM_ENABLE_MULTIPROCESSING", "1"),
    # How the engine process starts: fork | spawn | auto (fork, unless torch is
    # already imported here: a forked child cannot use an OpenMP pool its
    # parent started; vLLM forces spawn for CUDA the same way).
    "TRACEVLLM_WORKER_MULTIPROC_METHOD": lambda: os.environ.get(
        "TRACEVLLM_WORKER_MULTIPROC_METHOD", "auto"
    ),
    # Where the default model is converted to once (an HF directory).
    "TRACEVLLM_CACHE_DIR": lambda: os.path.expanduser(
        os.environ.get("TRACEVLLM_CACHE_DIR", "~/.cache/tracevllm")
    ),
    # How long the frontend waits for the engine process's READY (seconds).
    "TRACEVLLM_ENGINE_READY_TIMEOUT_S": lambda: float(
        os.environ.get("TRACEVLLM_ENGINE_READY_TIMEOUT_S", "600")
    ),
    # How long the executor waits for the workers' answer to one step before
    # it gives up with TimeoutError (seconds; vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS).
    "TRACEVLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": lambda: float(
        os.environ.get("TRACEVLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300")
    ),
    # How long the frontend waits for an engine output, while requests are in
    # flight, before it warns that the engine may be hung (seconds; vLLM's
    # VLLM_ENGINE_ITERATION_TIMEOUT_S). It keeps waiting after the warning.
    "TRACEVLLM_ENGINE_ITERATION_TIMEOUT_S": lambda: float(
        os.environ.get("TRACEVLLM_ENGINE_ITERATION_TIMEOUT_S", "60")
    ),
    # Tracing detail when none is passed in code: off | request | full.
    "TRACEVLLM_TRACE": lambda: os.environ.get("TRACEVLLM_TRACE", "off"),
    # Plug course labs into the running engine (tracevllm/labs.py): lab
    # numbers or lab folders, comma-separated, e.g. "03" or "01,05".
    "TRACEVLLM_LAB": lambda: os.environ.get("TRACEVLLM_LAB") or None,
    # Log level of the "tracevllm" logger (tracevllm/logger.py; vLLM's
    # VLLM_LOGGING_LEVEL, whose default is INFO).
    "TRACEVLLM_LOGGING_LEVEL": lambda: os.environ.get("TRACEVLLM_LOGGING_LEVEL", "WARNING"),
    # 0: tracevllm leaves logging to the application (vLLM's VLLM_CONFIGURE_LOGGING).
    "TRACEVLLM_CONFIGURE_LOGGING": _bool("TRACEVLLM_CONFIGURE_LOGGING", "1"),
    # CPU matmuls through oneDNN on weights packed once at load, as vLLM's CPU
    # backend (0: plain F.linear, for comparing).
    "TRACEVLLM_CPU_ONEDNN_GEMM": _bool("TRACEVLLM_CPU_ONEDNN_GEMM", "1"),
    # Torch intra-op threads in the engine (0: torch's default, less the reserved).
    "TRACEVLLM_NUM_THREADS": _count("TRACEVLLM_NUM_THREADS", "0"),
    # CPUs the engine's torch threads leave to other work, such as a busy
    # frontend (vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU, whose default is 1; see
    # platforms/cpu.py for why tracevllm's is 0). TRACEVLLM_NUM_THREADS wins.
    "TRACEVLLM_CPU_NUM_OF_RESERVED_CPU": _count("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
    # With neither of the two above set and one rank on the machine, the
    # engine adapts its thread count while it runs (worker/cpu_threads.py);
    # 0 keeps torch's default count fixed instead. tracevllm's own.
    "TRACEVLLM_CPU_ADAPTIVE_THREADS": _bool("TRACEVLLM_CPU_ADAPTIVE_THREADS", "1"),
    # The most memory xgrammar's compiler keeps compiled grammars in, in MiB
    # (vLLM's VLLM_XGRAMMAR_CACHE_MB; least recently used dropped first). A
    # whole number >= 0: vLLM passes a negative one on, which xgrammar reads
    # as no limit at all.
    "TRACEVLLM_XGRAMMAR_CACHE_MB": _count("TRACEVLLM_XGRAMMAR_CACHE_MB", "512"),
    # How long `tracevllm serve` keeps an idle connection open after a
    # response, in seconds (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE).
    "TRACEVLLM_HTTP_TIMEOUT_KEEP_ALIVE": _count("TRACEVLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"),
    # How many decoder layers each pipeline stage runs, comma-separated, e.g.
    # "8,8,8,6" (vLLM's VLLM_PP_LAYER_PARTITION); unset: an even split.
    "TRACEVLLM_PP_LAYER_PARTITION": lambda: os.environ.get("TRACEVLLM_PP_LAYER_PARTITION") or None,
    # This machine's address as the other machines of a Ray cluster should
    # reach it (vLLM's VLLM_HOST_IP); unset: the address of the interface
    # that routes outwards. Set it on each node, to that node's own address.
    "TRACEVLLM_HOST_IP": lambda: os.environ.get("TRACEVLLM_HOST_IP", ""),
    # The NixlConnector's side channel, where a decode engine's workers fetch
    # a prefill engine's NIXL agent metadata (vLLM's VLLM_NIXL_SIDE_CHANNEL_*).
    "TRACEVLLM_NIXL_SIDE_CHANNEL_HOST": lambda: os.environ.get(
        "TRACEVLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"
    ),
    "TRACEVLLM_NIXL_SIDE_CHANNEL_PORT": _count("TRACEVLLM_NIXL_SIDE_CHANNEL_PORT", "5600"),
    # Seconds a prefill engine holds a finished request's blocks for a reader
    # that never comes (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT before 0.22's leases).
    "TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT": _count("TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480"),
}

if TYPE_CHECKING:  # the names above, as module attributes
    TRACEVLLM_ENABLE_MULTIPROCESSING: bool
    TRACEVLLM_WORKER_MULTIPROC_METHOD: str
    TRACEVLLM_CACHE_DIR: str
    TRACEVLLM_ENGINE_READY_TIMEOUT_S: float
    TRACEVLLM_EXECUTE_MODEL_TIMEOUT_SECONDS: float
    TRACEVLLM_ENGINE_ITERATION_TIMEOUT_S: float
    TRACEVLLM_TRACE: str
    TRACEVLLM_LAB: str | None
    TRACEVLLM_LOGGING_LEVEL: str
    TRACEVLLM_CONFIGURE_LOGGING: bool
    TRACEVLLM_NUM_THREADS: int
    TRACEVLLM_CPU_NUM_OF_RESERVED_CPU: int
    TRACEVLLM_CPU_ADAPTIVE_THREADS: bool
    TRACEVLLM_CPU_ONEDNN_GEMM: bool
    TRACEVLLM_XGRAMMAR_CACHE_MB: int
    TRACEVLLM_HTTP_TIMEOUT_KEEP_ALIVE: int
    TRACEVLLM_PP_LAYER_PARTITION: str | None
    TRACEVLLM_HOST_IP: str
    TRACEVLLM_NIXL_SIDE_CHANNEL_HOST: str
    TRACEVLLM_NIXL_SIDE_CHANNEL_PORT: int
    TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT: int


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_set(name: str) -> bool:
    """Whether the variable is set in the environment, not just defaulted (vLLM's)."""
    if name in environment_variables:
        return name in os.environ
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
