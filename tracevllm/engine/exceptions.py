"""Errors the frontend raises about the engine (vllm/v1/engine/exceptions.py)."""

from __future__ import annotations


class EngineDeadError(Exception):
    """The EngineCore process died; the engine cannot serve any more requests."""

    def __init__(self, *args: object, suppress_context: bool = False) -> None:
        msg = (
            "EngineCore encountered an issue and its process is gone. See the stack "
            "trace above (from the engine process) for the root cause; create a new "
            "LLM to continue."
        )
        super().__init__(msg, *args)
        # Make stack trace clearer when using with LLMEngine by
        # silencing irrelevant ZMQError.
        self.__suppress_context__ = suppress_context
