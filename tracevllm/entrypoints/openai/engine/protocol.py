"""The pieces of the OpenAI protocol every endpoint shares.

Mirrors vllm/entrypoints/openai/engine/protocol.py (``OpenAIBaseModel``,
``ErrorInfo``, ``ErrorResponse``, ``ModelCard``, ``ModelList``,
``UsageInfo``, ``StreamOptions``, ``FunctionDefinition``, ``FunctionCall``,
``ToolCall``, ``DeltaFunctionCall``, ``DeltaToolCall``). Two departures:
the models are *strict* (pydantic ``strict=True``), so ``"temperature":
"0.5"`` or ``"max_tokens": true`` is a 400 naming the field, as OpenAI's own
API answers, where vLLM's lax models convert them; and a field a model does
not know is logged as a warning (vLLM: a debug line), then ignored, as
vLLM's. What both generating endpoints take, and the checks every request
body passes, are in generate_request.py.
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tracevllm.logger import init_logger

logger = init_logger(__name__)


def random_uuid() -> str:
    return uuid.uuid4().hex


@functools.cache
def _field_names(cls: type[BaseModel]) -> frozenset[str]:
    """A model's field names and their aliases (what a body may name)."""
    names = set(cls.model_fields)
    names |= {field.alias for field in cls.model_fields.values() if field.alias}
    return frozenset(names)


class OpenAIBaseModel(BaseModel):
    # OpenAI's API takes (and ignores) fields it does not know, as vLLM's.
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="wrap")
    @classmethod
    def __log_extra_fields__(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if isinstance(data, dict) and (ignored := data.keys() - _field_names(cls)):
            # A warning, not vLLM's debug line: a misspelt parameter
            # ("max_token") is otherwise served as if it were not sent.
            logger.warning(
                "The following fields were present in the request but ignored: %s",
                sorted(map(str, ignored)),
            )
        return result


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tracevllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    # "schema" on the wire (a BaseModel attribute name pydantic reserves).
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    # "text" (no constraint), "json_object" or "json_schema".
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # OpenAI's: hold the arguments to the schema. A named or "required" tool
    # choice does, always (structured outputs); vLLM's model lacks the field.
    strict: bool | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    # The arguments as a JSON text, as OpenAI sends them.
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A piece of a streamed tool call: the first one of a call has its id,
    type and name; the next ones only more of its arguments."""

    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


class GenerationError(Exception):
    """The engine failed a request (finish reason "error"): a 500."""

    def __init__(self, message: str = "Internal server error") -> None:
        super().__init__(message)
        self.status_code = 500
