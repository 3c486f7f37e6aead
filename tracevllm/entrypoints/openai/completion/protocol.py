"""/v1/completions: the request and the responses, as OpenAI's (plus vLLM's extras).

Mirrors vllm/entrypoints/openai/completion/protocol.py (``CompletionRequest``,
``CompletionLogProbs``, ``CompletionResponse``, ``CompletionStreamResponse``).
The sampling fields live in ``GenerateRequest`` (engine/protocol.py). Left
out: ``suffix``, ``logit_bias``, beam search, prompt logprobs, prompt
embeddings, KV-transfer parameters. Structured outputs come through
``structured_outputs`` or ``response_format`` (engine/protocol.py).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from tracevllm.entrypoints.openai.engine.protocol import (
    GenerateRequest,
    OpenAIBaseModel,
    UsageInfo,
    random_uuid,
)


class CompletionRequest(GenerateRequest):
    # A string, a batch of strings, token ids, or a batch of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # The stop string or stop token id that ended it (vLLM's extra).
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
