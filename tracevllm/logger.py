"""Logging configuration for tracevllm: one handler on the "tracevllm" logger.

vLLM's vllm/logger.py: at import, ``_configure_vllm_root_logger`` gives the
package's logger a stream handler with vLLM's format (``LEVEL date time
[file:line] message``) at ``VLLM_LOGGING_LEVEL``, and stops its records from
propagating to the root logger; every module gets its logger from
``init_logger(__name__)``. Here the same under tracevllm's names:
``TRACEVLLM_LOGGING_LEVEL`` (default ``WARNING``, where vLLM's is ``INFO``:
``make trace`` prints its own views, and the engine's INFO lines would
interleave with them) and ``TRACEVLLM_CONFIGURE_LOGGING`` (``0`` leaves
logging to the application, as vLLM's ``VLLM_CONFIGURE_LOGGING=0``: the
records then propagate to the root logger, where pytest's ``caplog`` reads
them). ``TRACEVLLM_LOGGING_LEVEL=INFO`` shows, for example, the adaptive CPU
thread count's changes (``CPU threads: 2 -> 1``).

vLLM's colour, prefix, JSON config file and log-once helpers are left out.
Every module's logger is ``init_logger(__name__)``, as in vLLM: a child of
"tracevllm" (``logging.getLogger(__name__)`` would return the same one).
"""

from __future__ import annotations

import logging
import sys

from tracevllm import envs

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"
_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def _configure_tracevllm_root_logger() -> None:
    """Give the "tracevllm" logger its handler and level, once per process."""
    if not envs.TRACEVLLM_CONFIGURE_LOGGING:
        return
    level = envs.TRACEVLLM_LOGGING_LEVEL.upper()
    if level not in _LEVELS:
        raise ValueError(
            f"TRACEVLLM_LOGGING_LEVEL={envs.TRACEVLLM_LOGGING_LEVEL!r} is not a log level: "
            f"use one of {', '.join(_LEVELS)}"
        )
    root = logging.getLogger("tracevllm")
    if any(getattr(h, "_tracevllm", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
    handler.setLevel(level)
    handler._tracevllm = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def init_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (vLLM's ``init_logger``)."""
    return logging.getLogger(name)


_configure_tracevllm_root_logger()
