"""/v1/chat/completions: the request and the responses, as OpenAI's (plus vLLM's extras).

Mirrors vllm/entrypoints/openai/chat_completion/protocol.py
(``ChatCompletionRequest``, ``ChatMessage``, ``ChatCompletionLogProbs``,
``ChatCompletionResponse``, ``ChatCompletionStreamResponse``) and
``DeltaMessage`` from vllm/entrypoints/openai/engine/protocol.py. Messages
are checked by entrypoints/chat_utils.py (text only). Left out: tools and
tool calls, reasoning, ``logit_bias``, beam search, documents, KV-transfer
parameters. A ``chat_template`` sent with a request is refused unless the
server trusts it (``--trust-request-chat-template``, vLLM's rule).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from tracevllm.entrypoints.openai.engine.protocol import (
    GenerateRequest,
    OpenAIBaseModel,
    UsageInfo,
    random_uuid,
)


class ChatCompletionRequest(GenerateRequest):
    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    # Deprecated by OpenAI in favour of max_completion_tokens; both are taken.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # vLLM's extra parameters.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
