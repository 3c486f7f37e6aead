"""POST /v1/chat/completions: a conversation in, the assistant's reply out.

Mirrors vllm/entrypoints/openai/chat_completion/serving.py
(``OpenAIServingChat``: ``create_chat_completion``,
``chat_completion_stream_generator``, ``chat_completion_full_generator``,
``_create_chat_logprobs``). The messages go through the model's chat
template (entrypoints/chat_utils.py, the same path as ``LLM.chat``), so a
greedy reply equals ``LLM.chat``'s. Tools: a named or ``"required"``
``tool_choice`` is generated under its JSON schema (tool_parsers/utils.py)
and answered as ``tool_calls``, whole or streamed (tool_parsers/streaming.py),
with vLLM's finish reasons (``"tool_calls"`` for "required", the engine's
for a named function). Left out: tool-call parsers (so ``"auto"`` is refused),
reasoning parsers, ``echo`` of the last message, beam search, LoRA,
multimodal content.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from tracevllm import tracing
from tracevllm.entrypoints.chat_utils import make_tool_call_id
from tracevllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
)
from tracevllm.entrypoints.openai.engine.generate_request import (
    check_kv_transfer_params_producer,
)
from tracevllm.entrypoints.openai.engine.protocol import ErrorResponse, ToolCall
from tracevllm.entrypoints.openai.engine.serving import (
    OpenAIServing,
    create_error_response,
    get_max_tokens,
    is_template_error,
    usage_info,
)
from tracevllm.exceptions import VLLMValidationError
from tracevllm.outputs import RequestOutput, SampleLogprobs
from tracevllm.sampling_params import CONSTRAINT_KINDS, RequestOutputKind, SamplingParams
from tracevllm.tool_parsers.streaming import (
    RequiredToolCallScanner,
    extract_named_tool_call_streaming,
)
from tracevllm.tool_parsers.utils import get_json_schema_from_tools
from tracevllm.tracing import records

if TYPE_CHECKING:
    from fastapi import Request


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"
    response_role = "assistant"

    # --8<-- [start:create_chat_completion]
    @tracing.instrument("OpenAIServingChat.create_chat_completion", parent=records.http_parent)
    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request | None = None
    ) -> AsyncGenerator[str] | ChatCompletionResponse | ErrorResponse:
        """Render the conversation, start generate(), then answer whole or stream."""
        if (error := self._check_model(request)) is not None:
            return error
        if (error := self._check_chat_template(request.chat_template)) is not None:
            return error
        if request.top_logprobs and not request.logprobs:
            return create_error_response(
                "top_logprobs needs logprobs to be true.", param="top_logprobs"
            )
        if request.tool_choice == "auto":
            return create_error_response(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set; tracevllm has no tool-call parser. Send tool_choice "required" '
                'or {"type": "function", "function": {"name": ...}}, served through '
                "structured outputs (or leave tools out).",
                param="tool_choice",
            )
        try:
            schema = get_json_schema_from_tools(request.tool_choice, request.tools)
        except ValueError as e:
            return create_error_response(str(e), param="tools")
        if schema is not None:
            # vLLM's ToolParser.adjust_request: the tools' schema replaces any
            # constraint the request set. The options stay (as under
            # response_format): tracevllm reads disable_any_whitespace from the
            # request, vLLM from the server's config.
            options = {
                k: v
                for k, v in (request.structured_outputs or {}).items()
                if k not in CONSTRAINT_KINDS
            }
            request.structured_outputs, request.response_format = options | {"json": schema}, None
        request_id = f"{self.request_id_prefix}-{self._base_request_id(raw_request)}"
        try:
            text, prompt_token_ids = await self.render_chat(request)
            prompt = {"prompt": text, "prompt_token_ids": prompt_token_ids}
            sampling_params = self._sampling_params(request, len(prompt_token_ids))
            self.validate_inputs(prompt, sampling_params)
        except Exception as e:  # the request's own fault: a 400 (a template's too)
            if not isinstance(e, (ValueError, TypeError)) and not is_template_error(e):
                raise
            return self.create_bad_request_response(e, request)
        result_generator = self.engine_client.generate(
            prompt,
            sampling_params,
            request_id,
            trace_headers=self._get_trace_headers(),
            priority=request.priority,
        )
        model_name = self.models.model_name()
        if request.stream:
            return self.chat_completion_stream_generator(
                request, result_generator, request_id, model_name, len(prompt_token_ids)
            )
        return await self.chat_completion_full_generator(
            request, result_generator, request_id, model_name
        )

    # --8<-- [end:create_chat_completion]

    def _sampling_params(self, request: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
        requested = (
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens
        )
        max_tokens = get_max_tokens(
            self.max_model_len, requested, prompt_len, self.default_sampling_params
        )
        check_kv_transfer_params_producer(
            request.kv_transfer_params,
            max_tokens,
            self.engine_client.vllm_config.kv_transfer_config,
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens",
        )
        return SamplingParams(
            **request.sampling_kwargs(self.default_sampling_params),  # type: ignore[arg-type]
            max_tokens=max_tokens,
            logprobs=request.top_logprobs if request.logprobs else None,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            extra_args=(
                {"kv_transfer_params": request.kv_transfer_params}
                if request.kv_transfer_params
                else None
            ),
        )

    # --8<-- [start:chat_completion_stream_generator]
    async def chat_completion_stream_generator(
        self,
        request: ChatCompletionRequest,
        result_generator: AsyncIterator[RequestOutput],
        request_id: str,
        model_name: str,
        num_prompt_tokens: int,
    ) -> AsyncGenerator[str]:
        """Server-sent events, as OpenAI's: a first chunk per choice with the
        role, then the deltas (content, or pieces of tool calls), the finish
        reason, the usage chunk if asked for, and ``data: [DONE]``."""
        num_choices = request.num_choices
        previous_num_tokens = [0] * num_choices
        # A "required" reply's calls, scanned as they come (one scanner per choice).
        required = request.tool_choice == "required"
        scanners = [RequiredToolCallScanner() for _ in range(num_choices if required else 0)]
        tools_streamed = [False] * num_choices
        created = int(time.time())

        def chunk(index: int, delta: DeltaMessage, **fields: Any) -> str:
            choice = ChatCompletionResponseStreamChoice(index=index, delta=delta, **fields)
            response = ChatCompletionStreamResponse(
                id=request_id,
                object="chat.completion.chunk",
                created=created,
                model=model_name,
                choices=[choice],
            )
            return f"data: {response.model_dump_json(exclude_unset=True)}\n\n"

        try:
            first_iteration = True
            async for res in result_generator:
                if first_iteration:  # inside the try: an error before it is the first event
                    for i in range(num_choices):
                        yield chunk(i, DeltaMessage(role=self.response_role, content=""))
                    first_iteration = False
                for output in res.outputs:
                    i = output.index
                    delta_text = output.text
                    # vLLM's rule: skip only an output with no text, no new
                    # token and nothing before it. A token whose text is held
                    # back (half a UTF-8 character, a possible stop string)
                    # still goes out, with its logprobs and an empty delta.
                    if not delta_text and not output.token_ids and not previous_num_tokens[i]:
                        continue
                    logprobs = None
                    if request.logprobs and output.logprobs is not None:
                        logprobs = self._create_chat_logprobs(
                            output.logprobs, request.top_logprobs or 0
                        )
                    delta = self._delta_message(request, i, delta_text, scanners, tools_streamed)
                    previous_num_tokens[i] += len(output.token_ids)
                    if delta is None:  # a tool call not announced yet
                        if output.finish_reason is None and logprobs is None:
                            continue
                        delta = DeltaMessage()
                    finish_reason = output.finish_reason
                    if finish_reason is not None:
                        # Before it is sent.
                        self._raise_if_error(finish_reason, request_id, output.stop_reason)
                        if tools_streamed[i] and request.named_tool is None:
                            finish_reason = "tool_calls"  # "required" (OpenAI's, vLLM's)
                    if delta.tool_calls and not request.parallel_tool_calls:
                        delta.tool_calls = [call for call in delta.tool_calls if call.index == 0]
                    yield chunk(
                        i,
                        delta,
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=output.stop_reason,
                    )
            if request.include_usage:
                usage = usage_info(num_prompt_tokens, sum(previous_num_tokens))
                final = ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model_name, choices=[], usage=usage
                )
                yield f"data: {final.model_dump_json(exclude_unset=True)}\n\n"
        except Exception as e:
            # The status (200) is sent already: the error goes in the stream.
            yield f"data: {self.create_streaming_error_response(e)}\n\n"
        yield "data: [DONE]\n\n"

    # --8<-- [end:chat_completion_stream_generator]

    @staticmethod
    def _delta_message(
        request: ChatCompletionRequest,
        i: int,
        delta_text: str,
        scanners: list[RequiredToolCallScanner],
        tools_streamed: list[bool],
    ) -> DeltaMessage | None:
        """Choice ``i``'s new text as a delta: content, or, under a forced
        tool choice, pieces of tool calls (None: nothing to show yet)."""
        if (name := request.named_tool) is not None:
            delta, tools_streamed[i] = extract_named_tool_call_streaming(
                delta_text, name, tools_streamed[i]
            )
            return delta
        if request.tool_choice == "required":
            required = scanners[i].feed(delta_text)
            tools_streamed[i] |= required is not None
            return required
        return DeltaMessage(content=delta_text)

    async def chat_completion_full_generator(
        self,
        request: ChatCompletionRequest,
        result_generator: AsyncIterator[RequestOutput],
        request_id: str,
        model_name: str,
    ) -> ChatCompletionResponse | ErrorResponse:
        final_res: RequestOutput | None = None
        try:
            async for res in result_generator:
                final_res = res
        except (ValueError, TypeError) as e:
            return self.create_bad_request_response(e, request)
        assert final_res is not None
        choices = []
        for output in final_res.outputs:
            try:
                self._raise_if_error(output.finish_reason, request_id, output.stop_reason)
            except VLLMValidationError as e:  # the engine's reason it failed: a 400
                return self.create_bad_request_response(e, request)
            logprobs = None
            if request.logprobs and output.logprobs is not None:
                logprobs = self._create_chat_logprobs(output.logprobs, request.top_logprobs or 0)
            calls, content = self._parse_tool_calls_from_content(request, output.text)
            tool_calls = [ToolCall(id=make_tool_call_id(), function=call) for call in calls or ()]
            if not request.parallel_tool_calls:
                tool_calls = tool_calls[:1]
            finish_reason = output.finish_reason
            if request.tool_choice == "required" and finish_reason == "stop":
                finish_reason = "tool_calls"  # a named function's stays "stop" (OpenAI's)
            choices.append(
                ChatCompletionResponseChoice(
                    index=output.index,
                    message=ChatMessage(
                        role=self.response_role,
                        content=content or "",
                        tool_calls=tool_calls,
                    ),
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=output.stop_reason,
                )
            )
        num_generated = sum(len(output.token_ids) for output in final_res.outputs)
        usage = usage_info(len(final_res.prompt_token_ids), num_generated)
        return ChatCompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=usage,
            kv_transfer_params=final_res.kv_transfer_params,
        )

    @staticmethod
    def _create_chat_logprobs(
        logprobs: SampleLogprobs, top_logprobs: int
    ) -> ChatCompletionLogProbs:
        """Per token: its text, logprob and bytes, and the ``top_logprobs``
        most likely tokens at that position, by rank."""
        content = []
        for position in logprobs:
            sampled = next(iter(position.values()))  # the sampled token comes first
            token = sampled.decoded_token or ""
            ranked = sorted(
                (p for p in position.values() if p.rank is not None and p.rank <= top_logprobs),
                key=lambda p: p.rank or 0,
            )
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=max(sampled.logprob, -9999.0),
                    bytes=list(token.encode("utf-8", errors="replace")),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=p.decoded_token or "",
                            logprob=max(p.logprob, -9999.0),
                            bytes=list((p.decoded_token or "").encode("utf-8", errors="replace")),
                        )
                        for p in ranked
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)
