"""What every OpenAI endpoint's handler shares: errors, the model check,
request ids, trace headers, max_tokens.

Mirrors vllm/entrypoints/openai/engine/serving.py (``OpenAIServing``:
``create_error_response``, ``_check_model``, ``_base_request_id``,
``_get_trace_headers``, ``_parse_tool_calls_from_content``) and
``create_error_response`` / ``get_max_tokens`` from vllm/entrypoints/utils.py.
A ``VLLMValidationError`` becomes a 400 whose ``param`` is its parameter; a
``ValueError`` or ``TypeError`` from the engine's own checks (SamplingParams,
the input processor) a 400 whose ``param`` is the field the message names.
Left out: LoRA adapters, beam search, request logging, data-parallel ranks.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from tracevllm import tracing
from tracevllm.engine.exceptions import EngineDeadError
from tracevllm.entrypoints.chat_utils import apply_chat_template, parse_chat_messages
from tracevllm.entrypoints.openai.engine.protocol import (
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    FunctionDefinition,
    GenerationError,
    OpenAIBaseModel,
    UsageInfo,
    random_uuid,
)
from tracevllm.exceptions import VLLMValidationError
from tracevllm.logger import init_logger

if TYPE_CHECKING:
    from fastapi import Request

    from tracevllm.engine.async_llm import AsyncLLM
    from tracevllm.entrypoints.openai.models.serving import OpenAIServingModels

logger = init_logger(__name__)

# A "required" tool choice's reply: a JSON list of {"name", "parameters"}.
_FUNCTION_LIST = TypeAdapter(list[FunctionDefinition])


def create_error_response(
    message: str | Exception,
    err_type: str = "BadRequestError",
    status_code: HTTPStatus = HTTPStatus.BAD_REQUEST,
    param: str | None = None,
) -> ErrorResponse:
    """OpenAI's error object for a message or an exception (its kind sets the status)."""
    if isinstance(message, Exception):
        exc = message
        if isinstance(exc, EngineDeadError):
            err_type, status_code = "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR
            message = str(exc)
        elif isinstance(exc, GenerationError):
            err_type, status_code = "InternalServerError", HTTPStatus(exc.status_code)
            message = str(exc)
        elif isinstance(exc, VLLMValidationError):
            err_type, status_code = "BadRequestError", HTTPStatus.BAD_REQUEST
            message, param = str(exc), param or exc.parameter
        elif isinstance(exc, (ValueError, TypeError, OverflowError)) or is_template_error(exc):
            err_type, status_code = "BadRequestError", HTTPStatus.BAD_REQUEST
            message = str(exc)
        else:
            # Not the client's doing: no internals in the answer, all of it in the log.
            logger.error("Internal error", exc_info=exc)
            err_type, status_code = "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR
            message = f"Internal server error ({type(exc).__name__}); see the server's log."
    return ErrorResponse(
        error=ErrorInfo(message=message, type=err_type, param=param, code=status_code.value)
    )


def is_template_error(exc: Exception) -> bool:
    """A chat template that failed to render (jinja2.TemplateError): the request's fault."""
    return any(cls.__name__ == "TemplateError" for cls in type(exc).__mro__)


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def get_max_tokens(
    max_model_len: int, max_tokens: int | None, input_length: int, default: dict[str, Any]
) -> int:
    """What a request may generate: its max_tokens (or the model's default),
    never past the end of the context."""
    if input_length >= max_model_len:
        raise ValueError(
            f"Input length ({input_length}) leaves no room to generate in the model's "
            f"maximum context length ({max_model_len}): the prompt must be shorter."
        )
    fallback = max_tokens if max_tokens is not None else default.get("max_tokens")
    return min(v for v in (max_model_len - input_length, fallback) if v is not None)


class OpenAIServing:
    """The base of each endpoint's handler (completions, chat)."""

    # What the response ids start with ("cmpl", "chatcmpl").
    request_id_prefix = ""

    def __init__(
        self,
        engine_client: AsyncLLM,
        models: OpenAIServingModels,
        trust_request_chat_template: bool = False,
    ) -> None:
        self.engine_client = engine_client
        # A template sent with a request runs on this server: only if trusted
        # (vLLM's --trust-request-chat-template, off by default).
        self.trust_request_chat_template = trust_request_chat_template
        self.models = models
        self.model_config = engine_client.model_config
        self.max_model_len = self.model_config.get_max_model_len()
        # The model's generation-config defaults (temperature, top_p, ...).
        self.default_sampling_params = self.model_config.get_diff_sampling_param()

    def create_bad_request_response(
        self, exc: Exception, request: OpenAIBaseModel
    ) -> ErrorResponse:
        """A 400 for the engine's own validation error, naming the parameter:
        the first request field its message names (``temperature must be
        ...``); one about the prompt's length or tokens names the prompt. A
        ``VLLMValidationError`` carries its parameter (vLLM raises one where
        tracevllm's SamplingParams raise a plain ``ValueError``)."""
        if isinstance(exc, VLLMValidationError) and exc.parameter is not None:
            return create_error_response(exc)
        message = str(exc)
        fields = type(request).model_fields
        words = re.findall(r"[A-Za-z_]+", message)
        param = next((word for word in words if word in fields and word != "model"), None)
        if param == "logprobs" and "top_logprobs" in fields:
            param = "top_logprobs"  # chat: the count is top_logprobs
        if param is None and ("prompt" in message.lower() or message.startswith("Input length")):
            param = "messages" if "messages" in fields else "prompt"
        return create_error_response(exc, param=param)

    def create_streaming_error_response(self, exc: Exception) -> str:
        return json.dumps(create_error_response(exc).model_dump())

    def _check_chat_template(self, chat_template: str | None) -> ErrorResponse | None:
        if chat_template is None or self.trust_request_chat_template:
            return None
        return create_error_response(
            "chat_template: this server does not run templates sent with a request; start "
            "it with --trust-request-chat-template to allow them.",
            param="chat_template",
        )

    async def render_chat(self, request: Any) -> tuple[str, list[int]]:
        """The conversation through the chat template, off the event loop (a
        template and a tokenizer take CPU time every other request waits for)."""
        return await asyncio.to_thread(
            apply_chat_template,
            self.engine_client.get_tokenizer(),
            parse_chat_messages(request.messages),
            request.chat_template,
            request.add_generation_prompt,
            request.continue_final_message,
            # vLLM hands the tools to the template unless tool_choice is "none"
            # and --exclude-tools-when-tool-choice-none is set (not a tracevllm flag).
            [tool.model_dump(exclude_none=True) for tool in request.tools or ()] or None,
        )

    def validate_inputs(self, prompt: Any, params: Any) -> None:
        """Run the engine's entry checks (InputProcessor.process_inputs) on a
        request before its response starts, so that a bad one is a 400."""
        self.engine_client.input_processor.process_inputs("validate", prompt, params)

    def _check_model(self, request: OpenAIBaseModel) -> ErrorResponse | None:
        model = getattr(request, "model", None)
        if model is None or self.models.is_base_model(model):
            return None
        return create_error_response(
            f"The model `{model}` does not exist.",
            err_type="NotFoundError",
            status_code=HTTPStatus.NOT_FOUND,
            param="model",
        )

    @staticmethod
    def _base_request_id(raw_request: Request | None, default: str | None = None) -> str:
        """The request id: the client's X-Request-Id header, if it sent one."""
        if raw_request is not None and (req_id := raw_request.headers.get("X-Request-Id")):
            return str(req_id)
        return random_uuid() if default is None else default

    @staticmethod
    def _get_trace_headers() -> Mapping[str, str] | None:
        """The context the engine's spans of this request join: the handler's
        own span (whose parent is the client's ``traceparent``); None with
        tracing off."""
        return tracing.inject_trace_context() or None

    @staticmethod
    def _parse_tool_calls_from_content(
        request: Any, content: str
    ) -> tuple[list[FunctionCall] | None, str | None]:
        """The calls a forced tool choice's reply holds, and what is left of
        the content (vLLM's standard JSON path, without a tool parser): a
        named function's reply is its arguments; a ``"required"`` reply is a
        JSON array of ``{"name", "parameters"}`` (none, if it is not one: cut
        short by max_tokens, say)."""
        if (name := request.named_tool) is not None:
            return [FunctionCall(name=name, arguments=content)], None
        if request.tool_choice == "required":
            try:
                calls = _FUNCTION_LIST.validate_json(content)
            except ValidationError:
                calls = []
            return [
                FunctionCall(name=c.name, arguments=json.dumps(c.parameters, ensure_ascii=False))
                for c in calls
            ], None
        return None, content

    def _raise_if_error(
        self, finish_reason: str | None, request_id: str, stop_reason: int | str | None = None
    ) -> None:
        """vLLM's: finish reason "error" is a 500 "Internal server error".
        tracevllm: one whose stop_reason holds the engine's reason (the
        request's own constraint allowed no token, or did not compile) is a
        400 with that reason, naming the field."""
        if finish_reason == "error":
            if isinstance(stop_reason, str):
                field = stop_reason.split(":", 1)[0].split(".", 1)[0]
                raise VLLMValidationError(stop_reason, parameter=field)
            logger.error("Request %s failed with an internal error during generation", request_id)
            raise GenerationError()
