"""POST /v1/completions: prompts in, completions out, whole or streamed.

Mirrors vllm/entrypoints/openai/completion/serving.py
(``OpenAIServingCompletion``: ``create_completion``,
``completion_stream_generator``, ``request_output_to_completion_response``,
``_create_completion_logprobs``). Each prompt of the request runs as its own
``AsyncLLM.generate()``; a request with n > 1 comes back as n choices per
prompt (choice index = prompt index * n + completion index). Left out:
``suffix``, prompt logprobs (so ``echo`` with ``logprobs``), beam search,
LoRA, prompt embeddings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from tracevllm import tracing
from tracevllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from tracevllm.entrypoints.openai.engine.generate_request import (
    check_kv_transfer_params_producer,
)
from tracevllm.entrypoints.openai.engine.protocol import ErrorResponse
from tracevllm.entrypoints.openai.engine.serving import (
    OpenAIServing,
    create_error_response,
    get_max_tokens,
    usage_info,
)
from tracevllm.exceptions import VLLMValidationError
from tracevllm.outputs import RequestOutput, SampleLogprobs
from tracevllm.sampling_params import RequestOutputKind, SamplingParams
from tracevllm.tracing import records
from tracevllm.utils.async_utils import merge_async_iterators

if TYPE_CHECKING:
    from fastapi import Request


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl"

    # --8<-- [start:create_completion]
    @tracing.instrument("OpenAIServingCompletion.create_completion", parent=records.http_parent)
    async def create_completion(
        self, request: CompletionRequest, raw_request: Request | None = None
    ) -> AsyncGenerator[str] | CompletionResponse | ErrorResponse:
        """Check the request, start one generate() per prompt, then either
        gather the final outputs (one JSON response) or return the SSE stream."""
        if (error := self._check_model(request)) is not None:
            return error
        if request.suffix is not None:
            return create_error_response("suffix is not currently supported", param="suffix")
        if request.echo and request.logprobs is not None:
            return create_error_response(
                "echo with logprobs needs prompt logprobs, which tracevllm does not compute",
                param="echo",
            )
        request_id = f"{self.request_id_prefix}-{self._base_request_id(raw_request)}"
        try:
            # Off the event loop: a long prompt must not hold every other request.
            prompts = await asyncio.to_thread(self._engine_prompts, request)
            params = [self._sampling_params(request, len(p["prompt_token_ids"])) for p in prompts]
            for prompt, sampling_params in zip(prompts, params):
                # Refused now, as a 400, not half-way through a 200 stream.
                self.validate_inputs(prompt, sampling_params)
        except (ValueError, TypeError) as e:
            return self.create_bad_request_response(e, request)
        trace_headers = self._get_trace_headers()
        generators = [
            self.engine_client.generate(
                prompt,
                sampling_params,
                f"{request_id}-{i}",
                trace_headers=trace_headers,
                priority=request.priority,
            )
            for i, (prompt, sampling_params) in enumerate(zip(prompts, params))
        ]
        result_generator = merge_async_iterators(*generators)
        model_name = self.models.model_name()
        if request.stream:
            return self.completion_stream_generator(
                request, prompts, result_generator, request_id, model_name
            )
        final_res_batch: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for i, res in result_generator:
                final_res_batch[i] = res
        except (ValueError, TypeError) as e:
            return self.create_bad_request_response(e, request)
        outputs = [res for res in final_res_batch if res is not None]
        try:
            return self.request_output_to_completion_response(
                outputs, request, request_id, model_name
            )
        except VLLMValidationError as e:  # the engine's reason a request failed: a 400
            return self.create_bad_request_response(e, request)

    # --8<-- [end:create_completion]

    def _engine_prompts(self, request: CompletionRequest) -> list[dict[str, Any]]:
        """Each prompt as text + token ids (tokenized once, here)."""
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            items: list[Any] = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise ValueError("prompt must not be empty.")
        tokenize = self.engine_client.input_processor.tokenize
        prompts = []
        for item in items:
            if isinstance(item, str):
                text, ids = tokenize(item)
            else:
                # Token ids: their text too, for echo (vLLM detokenizes them as well).
                ids = list(item)
                text = self.engine_client.get_tokenizer().decode(ids) if request.echo else None
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return prompts

    def _sampling_params(self, request: CompletionRequest, prompt_len: int) -> SamplingParams:
        max_tokens = get_max_tokens(
            self.max_model_len, request.max_tokens, prompt_len, self.default_sampling_params
        )
        check_kv_transfer_params_producer(
            request.kv_transfer_params,
            max_tokens,
            self.engine_client.vllm_config.kv_transfer_config,
        )
        return SamplingParams(
            **request.sampling_kwargs(self.default_sampling_params),  # type: ignore[arg-type]
            max_tokens=max_tokens,
            logprobs=request.logprobs,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            extra_args=(
                {"kv_transfer_params": request.kv_transfer_params}
                if request.kv_transfer_params
                else None
            ),
        )

    # --8<-- [start:completion_stream_generator]
    async def completion_stream_generator(
        self,
        request: CompletionRequest,
        prompts: list[dict[str, Any]],
        result_generator: AsyncIterator[tuple[int, RequestOutput]],
        request_id: str,
        model_name: str,
    ) -> AsyncGenerator[str]:
        """Server-sent events: one ``data: {chunk}`` per new piece of text,
        the usage chunk if asked for, then ``data: [DONE]``."""
        n = request.num_choices
        created = int(time.time())
        echoed = [False] * (len(prompts) * n)
        num_prompt_tokens = [len(p["prompt_token_ids"]) for p in prompts]
        previous_num_tokens = [0] * (len(prompts) * n)
        previous_text_lens = [0] * (len(prompts) * n)
        try:
            async for prompt_idx, res in result_generator:
                for output in res.outputs:
                    i = prompt_idx * n + output.index
                    delta_text = output.text
                    if request.echo and not echoed[i]:
                        delta_text = (prompts[prompt_idx]["prompt"] or "") + delta_text
                        echoed[i] = True
                    elif not delta_text and not output.token_ids and not previous_num_tokens[i]:
                        # vLLM's rule: skip only an output with no text, no new
                        # token and nothing before it. A token whose text is
                        # held back (half a UTF-8 character, a possible stop
                        # string) still goes out, with its logprobs.
                        continue
                    logprobs = None
                    if request.logprobs is not None and output.logprobs is not None:
                        logprobs = self._create_completion_logprobs(
                            output.logprobs, request.logprobs, previous_text_lens[i]
                        )
                    # The text sent so far, not the tokens' own texts (vLLM's offset).
                    previous_text_lens[i] += len(output.text)
                    previous_num_tokens[i] += len(output.token_ids)
                    # Before it is sent.
                    self._raise_if_error(output.finish_reason, request_id, output.stop_reason)
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        object="text_completion",
                        created=created,
                        model=model_name,
                        choices=[
                            CompletionResponseStreamChoice(
                                index=i,
                                text=delta_text,
                                logprobs=logprobs,
                                finish_reason=output.finish_reason,
                                stop_reason=output.stop_reason,
                            )
                        ],
                    )
                    yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
            if request.include_usage:
                usage = usage_info(sum(num_prompt_tokens), sum(previous_num_tokens))
                final = CompletionStreamResponse(
                    id=request_id, created=created, model=model_name, choices=[], usage=usage
                )
                yield f"data: {final.model_dump_json(exclude_unset=True)}\n\n"
        except Exception as e:
            # The status (200) is sent already: the error goes in the stream.
            yield f"data: {self.create_streaming_error_response(e)}\n\n"
        yield "data: [DONE]\n\n"

    # --8<-- [end:completion_stream_generator]

    def request_output_to_completion_response(
        self,
        final_res_batch: list[RequestOutput],
        request: CompletionRequest,
        request_id: str,
        model_name: str,
    ) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        num_prompt_tokens = num_generated_tokens = 0
        for prompt_idx, res in enumerate(final_res_batch):
            num_prompt_tokens += len(res.prompt_token_ids)
            for output in res.outputs:
                self._raise_if_error(output.finish_reason, request_id, output.stop_reason)
                text = output.text
                if request.echo:
                    text = (res.prompt or "") + text
                logprobs = None
                if request.logprobs is not None and output.logprobs is not None:
                    logprobs = self._create_completion_logprobs(output.logprobs, request.logprobs)
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_idx * request.num_choices + output.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                    )
                )
                num_generated_tokens += len(output.token_ids)
        usage = usage_info(num_prompt_tokens, num_generated_tokens)
        # vLLM's: the first prompt's (a disaggregated request has one).
        kv_transfer_params = final_res_batch[0].kv_transfer_params if final_res_batch else None
        return CompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=usage,
            kv_transfer_params=kv_transfer_params,
        )

    @staticmethod
    def _create_completion_logprobs(
        logprobs: SampleLogprobs, num_top: int, initial_text_offset: int = 0
    ) -> CompletionLogProbs:
        """OpenAI's legacy logprobs: per token its text, logprob, the top
        ``num_top`` alternatives, and where its text starts."""
        text_offset: list[int] = []
        token_logprobs: list[float | None] = []
        tokens: list[str] = []
        top_logprobs: list[dict[str, float] | None] = []
        offset = initial_text_offset
        for position in logprobs:
            # The first entry is the sampled token (LogprobsProcessor's order).
            sampled = next(iter(position.values()))
            token = sampled.decoded_token or ""
            tokens.append(token)
            token_logprobs.append(max(sampled.logprob, -9999.0))
            # The sampled token, then the num_top most likely (as vLLM's).
            ranked = sorted(position.values(), key=lambda p: p.rank or 0)[:num_top]
            top = {token: max(sampled.logprob, -9999.0)}
            top |= {(p.decoded_token or ""): max(p.logprob, -9999.0) for p in ranked}
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(token)
        return CompletionLogProbs(
            text_offset=text_offset,
            token_logprobs=token_logprobs,
            tokens=tokens,
            top_logprobs=top_logprobs,
        )
