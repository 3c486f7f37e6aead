"""Errors a request's checks raise, carrying the parameter they are about.

Mirrors vllm/exceptions.py (``VLLMValidationError``). The OpenAI server turns
one into a 400 whose ``param`` is the parameter, whether it was raised while
the request body was parsed (a pydantic validator) or later, by a handler.
Left out: ``VLLMNotFoundError`` and the others (tracevllm's server makes those
answers where it meets them).
"""

from __future__ import annotations

from typing import Any


class VLLMValidationError(ValueError):
    """A request's value was refused; ``parameter`` names the request field.

    A ``ValueError``, so code that catches those (the offline API, pydantic's
    validators) treats it as one.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        # vLLM appends the parameter and the value to the message.
        base = super().__str__()
        extras = []
        if self.parameter is not None:
            extras.append(f"parameter={self.parameter}")
        if self.value is not None:
            extras.append(f"value={self.value!r}")
        return f"{base} ({', '.join(extras)})" if extras else base
