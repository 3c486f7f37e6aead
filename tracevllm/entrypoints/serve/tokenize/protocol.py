"""POST /tokenize and /detokenize: the requests and responses.

Mirrors vllm/entrypoints/serve/tokenize/protocol.py
(``TokenizeCompletionRequest``, ``TokenizeChatRequest``,
``TokenizeResponse``, ``DetokenizeRequest``, ``DetokenizeResponse``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from tracevllm.entrypoints.openai.engine.protocol import OpenAIBaseModel


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
