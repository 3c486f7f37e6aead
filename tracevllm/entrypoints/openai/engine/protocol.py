"""The pieces of the OpenAI protocol every endpoint shares.

Mirrors vllm/entrypoints/openai/engine/protocol.py (``OpenAIBaseModel``,
``ErrorInfo``, ``ErrorResponse``, ``ModelCard``, ``ModelList``,
``UsageInfo``, ``StreamOptions``). One departure: the request models are
*strict* (pydantic ``strict=True``), so ``"temperature": "0.5"`` or
``"max_tokens": true`` is a 400 naming the field, as OpenAI's own API
answers, where vLLM's lax models would convert them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tracevllm.sampling_params import StructuredOutputsParams


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    # OpenAI's API takes (and ignores) fields it does not know, as vLLM's.
    model_config = ConfigDict(extra="allow", strict=True)


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


class GenerationError(Exception):
    """The engine failed a request (finish reason "error"): a 500."""

    def __init__(self, message: str = "Internal server error") -> None:
        super().__init__(message)
        self.status_code = 500


# vLLM's defaults when neither the request nor the model's generation config
# sets one (``_DEFAULT_SAMPLING_PARAMS`` in its request classes).
_DEFAULT_SAMPLING_PARAMS = {
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}


class GenerateRequest(OpenAIBaseModel):
    """The sampling fields /v1/completions and /v1/chat/completions share.

    vLLM writes them out in each request class; tracevllm writes them once.
    OpenAI's parameters first, then vLLM's extra ones (sent by the official
    client through ``extra_body``).
    """

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    # Structured outputs: vLLM's extra parameter, or OpenAI's response_format
    # ({"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}).
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_stream_options(self) -> GenerateRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        return self

    def sampling_kwargs(self, default_sampling_params: dict[str, object]) -> dict[str, object]:
        """SamplingParams keyword arguments; what the request leaves unset
        comes from the model's generation config, then vLLM's defaults."""
        kwargs: dict[str, object] = {}
        for name, default in _DEFAULT_SAMPLING_PARAMS.items():
            value = getattr(self, name)
            kwargs[name] = (
                value if value is not None else default_sampling_params.get(name, default)
            )
        return kwargs | dict(
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self._structured_outputs(),
        )

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """``structured_outputs``, with ``response_format``'s constraint laid over it.

        vLLM's rule (``to_sampling_params``: ``replace(structured_outputs,
        **response_format's)``): ``structured_outputs`` must hold a constraint
        of its own (a request with options only is refused, as vLLM's pydantic
        model refuses it); ``response_format`` then replaces a constraint of
        its own kind (``json`` for json_schema, ``json_object`` for
        json_object) and a constraint of another kind is a conflict: a 400.
        """
        so_params = None
        if self.structured_outputs is not None:
            try:
                so_params = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise TypeError(f"structured_outputs: {e}") from None
        fmt = self.response_format
        kwargs: dict[str, Any] = {}
        if fmt is not None and fmt.type == "json_object":
            kwargs["json_object"] = True
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError(
                    "When response_format type is 'json_schema', the 'json_schema' field "
                    "(with its 'schema') must be provided."
                )
            kwargs["json"] = fmt.json_schema.json_schema
        if not kwargs:
            return so_params
        if so_params is None:
            return StructuredOutputsParams(**kwargs)
        (new_kind,) = kwargs
        old_kind = so_params.kind
        if old_kind != new_kind:
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are "
                f"specified: response_format sets {new_kind!r} and structured_outputs sets "
                f"{old_kind!r}."
            )
        return msgspec.structs.replace(so_params, **kwargs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
