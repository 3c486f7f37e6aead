"""POST /v1/chat/completions: a conversation in, the assistant's reply out.

Mirrors vllm/entrypoints/openai/chat_completion/serving.py
(``OpenAIServingChat``: ``create_chat_completion``,
``chat_completion_stream_generator``, ``chat_completion_full_generator``,
``_create_chat_logprobs``). The messages go through the model's chat
template (entrypoints/chat_utils.py, the same path as ``LLM.chat``), so a
greedy reply equals ``LLM.chat``'s. Left out: tools, reasoning parsers,
``echo`` of the last message, beam search, LoRA, multimodal content.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from tracevllm import tracing
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
from tracevllm.entrypoints.openai.engine.protocol import ErrorResponse
from tracevllm.entrypoints.openai.engine.serving import (
    OpenAIServing,
    create_error_response,
    get_max_tokens,
    is_template_error,
    usage_info,
)
from tracevllm.outputs import RequestOutput, SampleLogprobs
from tracevllm.sampling_params import RequestOutputKind, SamplingParams
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
        return SamplingParams(
            **request.sampling_kwargs(self.default_sampling_params),  # type: ignore[arg-type]
            max_tokens=max_tokens,
            logprobs=request.top_logprobs if request.logprobs else None,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
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
        role, then content deltas, the finish reason, the usage chunk if asked
        for, and ``data: [DONE]``."""
        num_generated = [0] * request.n
        role_sent = [False] * request.n
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
            async for res in result_generator:
                for output in res.outputs:
                    i = output.index
                    if not role_sent[i]:
                        yield chunk(i, DeltaMessage(role=self.response_role, content=""))
                        role_sent[i] = True
                    num_generated[i] += len(output.token_ids)
                    if not output.text and output.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs and output.logprobs is not None:
                        logprobs = self._create_chat_logprobs(
                            output.logprobs, request.top_logprobs or 0
                        )
                    yield chunk(
                        i,
                        DeltaMessage(content=output.text),
                        logprobs=logprobs,
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                    )
                    self._raise_if_error(output.finish_reason, request_id)
            if request.include_usage:
                usage = usage_info(num_prompt_tokens, sum(num_generated))
                final = ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model_name, choices=[], usage=usage
                )
                yield f"data: {final.model_dump_json(exclude_unset=True)}\n\n"
        except Exception as e:
            # The status (200) is sent already: the error goes in the stream.
            yield f"data: {self.create_streaming_error_response(e)}\n\n"
        yield "data: [DONE]\n\n"

    # --8<-- [end:chat_completion_stream_generator]

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
            self._raise_if_error(output.finish_reason, request_id)
            logprobs = None
            if request.logprobs and output.logprobs is not None:
                logprobs = self._create_chat_logprobs(output.logprobs, request.top_logprobs or 0)
            choices.append(
                ChatCompletionResponseChoice(
                    index=output.index,
                    message=ChatMessage(role=self.response_role, content=output.text),
                    logprobs=logprobs,
                    finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason,
                )
            )
        num_generated = sum(len(output.token_ids) for output in final_res.outputs)
        usage = usage_info(len(final_res.prompt_token_ids), num_generated)
        return ChatCompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage)

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
