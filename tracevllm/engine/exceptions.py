"""Errors the frontend raises about the engine (vllm/v1/engine/exceptions.py)."""

from __future__ import annotations


class EngineGenerateError(Exception):
    """``AsyncLLM.generate()`` failed for this request; the engine goes on.

    Raised from the cause (``raise ... from e``): anything but a bad request
    (``ValueError``, ``TypeError``), a dead engine or a cancellation.
    """

    def __init__(self, message: str = "The request failed; see the cause above.") -> None:
        super().__init__(message)


class EngineDeadError(Exception):
    """The EngineCore process died; the engine cannot serve any more requests.

    The message says what happened when the frontend knows (the process
    exited with a signal or an exit code; a fatal error inside a step).
    """

    def __init__(self, reason: str | None = None, *, suppress_context: bool = False) -> None:
        reason = reason or "EngineCore encountered an issue and its process is gone."
        super().__init__(f"{reason} Create a new LLM to continue.")
        # Make stack trace clearer when using with LLMEngine by
        # silencing irrelevant ZMQError.
        self.__suppress_context__ = suppress_context


def describe_exit(exitcode: int | None) -> str:
    """'exited with signal 9 (SIGKILL)' or 'exited with exit code 1'."""
    import signal

    if exitcode is None:
        return "has exited"  # reaped elsewhere: the code is not known here
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return f"exited with signal {-exitcode} ({name})"
    return f"exited with exit code {exitcode}"
