"""/v1/chat/completions: the request and the responses, as OpenAI's (plus vLLM's extras).

Mirrors vllm/entrypoints/openai/chat_completion/protocol.py
(``ChatCompletionRequest``, ``ChatMessage``, ``ChatCompletionLogProbs``,
``ChatCompletionResponse``, ``ChatCompletionStreamResponse``) and
``ChatCompletionToolsParam``, ``ChatCompletionNamedToolChoiceParam``) and
``DeltaMessage`` from vllm/entrypoints/openai/engine/protocol.py. Messages
are checked by entrypoints/chat_utils.py (text only). Tools: ``tool_choice``
a named function or ``"required"`` is served through structured outputs, as
vLLM's default tool-call path; ``"auto"`` needs a tool parser, which
tracevllm does not have, so it is refused with vLLM's message (also when
``tools`` come without a ``tool_choice``: vLLM's default is then ``"auto"``).
Left out, and refused when asked for: the deprecated ``functions`` and
``function_call``, audio output, reasoning, beam search, documents,
``echo``, ``chat_template_kwargs``, ``kv_transfer_params`` with ``n`` > 1
(vLLM takes it; see engine/generate_request.py). A ``chat_template`` sent with a request is
refused unless the server trusts it (``--trust-request-chat-template``,
vLLM's rule).
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
    DeltaToolCall,
    FunctionDefinition,
    OpenAIBaseModel,
    ToolCall,
    UsageInfo,
    random_uuid,
)
from tracevllm.exceptions import VLLMValidationError
from tracevllm.structured_output.limits import check_json_schema

_USE_TOOLS = "deprecated by OpenAI; send tools and tool_choice instead"


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None


class ChatCompletionRequest(GenerateRequest):
    unsupported_fields: ClassVar[UnsupportedFields] = GenerateRequest.unsupported_fields | {
        "functions": ((None,), _USE_TOOLS),
        "function_call": ((None,), _USE_TOOLS),
        "audio": ((None,), "the output is text only"),
        "modalities": ((None, ["text"]), "the output is text only"),
        "web_search_options": ((None,), "there is no web search"),
        "reasoning_effort": ((None,), "there are no reasoning models or parsers"),
        "echo": ((False,), "it is not implemented"),
        "documents": ((None,), "the chat template is not given documents"),
        "chat_template_kwargs": ((None, {}), "the chat template is given no extra arguments"),
        "return_prompt_text": ((None, False), "responses carry no prompt text"),
    }

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
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice = "none"
    # False: at most one tool call in the reply (vLLM drops the others).
    parallel_tool_calls: bool | None = True
    # vLLM's: the KV connector's parameters for a disaggregated request (a
    # decode server's, from the prefill server's response); to extra_args.
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_kv_transfer_params(self) -> ChatCompletionRequest:
        check_kv_transfer_params_single(self.kv_transfer_params, 1, self.num_choices)
        return self

    # --8<-- [start:check_tool_usage]
    @model_validator(mode="after")
    def _check_tool_usage(self) -> ChatCompletionRequest:
        """vLLM's rules (``check_tool_usage``), on the parsed request."""
        if self.tools == []:
            raise VLLMValidationError(
                "`tools` must not be an empty array. Either provide at least one tool or "
                "omit the field entirely.",
                parameter="tools",
            )
        for i, tool in enumerate(self.tools or ()):
            # tracevllm: the limits a constraint is held to, whatever the
            # tool_choice. The parameters become the schema a named or
            # "required" choice is generated under, and every choice hands
            # them to the chat template: nested past Python's recursion
            # limit, a copy, a comparison or the template's tojson raised
            # RecursionError (a 500, or a 400 naming another field).
            if tool.function.parameters is not None:
                field = f"tools[{i}].function.parameters"
                try:
                    check_json_schema(tool.function.parameters, field)
                except ValueError as e:
                    raise VLLMValidationError(str(e), parameter="tools") from None
        if "tool_choice" not in self.model_fields_set and self.tools:
            self.tool_choice = "auto"  # OpenAI's default when tools are given
        choice = self.tool_choice
        if choice is None or choice == "none":
            return self
        if self.tools is None:
            raise VLLMValidationError(
                "When using `tool_choice`, `tools` must be set.", parameter="tool_choice"
            )
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            name = choice.function.name
            if not name:
                raise VLLMValidationError(
                    f"Invalid `name` in `function`: `{name}` in `tool_choice`!",
                    parameter="tool_choice",
                )
            if all(tool.function.name != name for tool in self.tools):
                raise VLLMValidationError(
                    "The tool specified in `tool_choice` does not match any of the "
                    "specified `tools`",
                    parameter="tool_choice",
                )
        return self

    # --8<-- [end:check_tool_usage]

    @property
    def named_tool(self) -> str | None:
        """The function a named ``tool_choice`` forces, else None."""
        choice = self.tool_choice
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            return choice.function.name
        return None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


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
    # vLLM's: what the KV connector returned (a prefill server's, for the decode server).
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


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
