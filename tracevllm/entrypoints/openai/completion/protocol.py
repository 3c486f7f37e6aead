"""/v1/completions: the request and the responses, as OpenAI's (plus vLLM's extras).

Mirrors vllm/entrypoints/openai/completion/protocol.py (``CompletionRequest``,
``CompletionLogProbs``, ``CompletionResponse``, ``CompletionStreamResponse``).
The sampling fields live in ``GenerateRequest`` (engine/generate_request.py).
Left out, and refused when asked for: ``suffix``, ``best_of`` above ``n``
(OpenAI's; vLLM 0.22.0 dropped it unread), beam search, prompt logprobs,
prompt embeddings; ``kv_transfer_params`` with several prompts or ``n`` > 1
(vLLM takes them; see engine/generate_request.py). Structured outputs come
through ``structured_outputs`` or ``response_format``.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from tracevllm.entrypoints.openai.engine.generate_request import (
    GenerateRequest,
    UnsupportedFields,
    check_kv_transfer_params_single,
)
from tracevllm.entrypoints.openai.engine.protocol import (
    OpenAIBaseModel,
    UsageInfo,
    random_uuid,
)
from tracevllm.exceptions import VLLMValidationError


class CompletionRequest(GenerateRequest):
    unsupported_fields: ClassVar[UnsupportedFields] = GenerateRequest.unsupported_fields | {
        "prompt_embeds": ((None,), "prompt embeddings are not taken; send text or token ids"),
    }

    # A string, a batch of strings, token ids, or a batch of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    # OpenAI's: generate best_of and return the n most likely. Only
    # best_of == n (the same as leaving it out) is served.
    best_of: int | None = None
    # vLLM's: the KV connector's parameters for a disaggregated request (a
    # decode server's, from the prefill server's response); to extra_args.
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_kv_transfer_params(self) -> CompletionRequest:
        prompt = self.prompt
        single = isinstance(prompt, str) or not prompt or isinstance(prompt[0], int)
        check_kv_transfer_params_single(
            self.kv_transfer_params, 1 if single else len(prompt), self.num_choices
        )
        return self

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.num_choices:
            raise VLLMValidationError(
                f"best_of is not supported by tracevllm: it generates the n ({self.num_choices}) "
                f"completions it returns, not best_of ({self.best_of}) to rank; leave best_of "
                "out or set it to n.",
                parameter="best_of",
            )
        return self


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
    # vLLM's: what the KV connector returned (a prefill server's, for the decode server).
    kv_transfer_params: dict[str, Any] | None = None


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
