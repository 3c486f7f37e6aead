"""POST /tokenize and /detokenize: the server's tokenizer, as a service.

Mirrors vllm/entrypoints/serve/tokenize/serving.py (``OpenAIServingTokenization``:
``create_tokenize``, ``create_detokenize``). A chat request is rendered through
the chat template first, exactly as /v1/chat/completions renders it.
"""

from __future__ import annotations

import asyncio

from tracevllm.engine.input_processor import check_text
from tracevllm.entrypoints.openai.engine.protocol import ErrorResponse
from tracevllm.entrypoints.openai.engine.serving import (
    OpenAIServing,
    create_error_response,
    is_template_error,
)
from tracevllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)


class OpenAIServingTokenization(OpenAIServing):
    async def create_tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse | ErrorResponse:
        if (error := self._check_model(request)) is not None:
            return error
        tokenizer = self.engine_client.get_tokenizer()
        try:
            if isinstance(request, TokenizeChatRequest):
                if (error := self._check_chat_template(request.chat_template)) is not None:
                    return error
                _, tokens = await self.render_chat(request)
            else:
                text = check_text(request.prompt, "prompt")
                tokens = await asyncio.to_thread(
                    tokenizer.encode, text, add_special_tokens=request.add_special_tokens
                )
        except Exception as e:  # the request's own fault: a 400 (a template's too)
            if not isinstance(e, (ValueError, TypeError)) and not is_template_error(e):
                raise
            return self.create_bad_request_response(e, request)
        token_strs = tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(
            tokens=tokens,
            token_strs=token_strs,
            count=len(tokens),
            max_model_len=self.max_model_len,
        )

    async def create_detokenize(
        self, request: DetokenizeRequest
    ) -> DetokenizeResponse | ErrorResponse:
        if (error := self._check_model(request)) is not None:
            return error
        vocab_size = self.model_config.vocab_size
        if bad := [t for t in request.tokens if t >= vocab_size]:
            return create_error_response(
                f"tokens {bad[:5]} are out of the vocabulary: token ids must be in "
                f"[0, {vocab_size - 1}].",
                param="tokens",
            )
        return DetokenizeResponse(prompt=self.engine_client.get_tokenizer().decode(request.tokens))
