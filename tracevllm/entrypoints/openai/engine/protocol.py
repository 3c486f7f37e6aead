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

from pydantic import BaseModel, ConfigDict, Field


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
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
