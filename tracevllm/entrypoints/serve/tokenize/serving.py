"""POST /tokenize and /detokenize: the server's tokenizer, as a service.

Mirrors vllm/entrypoints/serve/tokenize/serving.py (``OpenAIServingTokenization``:
``create_tokenize``, ``create_detokenize``). A chat request is rendered through
the chat template first, exactly as /v1/chat/completions renders it.
"""

from __future__ import annotations

from tracevllm.entrypoints.chat_utils import apply_chat_template, parse_chat_messages
from tracevllm.entrypoints.openai.engine.protocol import ErrorResponse
from tracevllm.entrypoints.openai.engine.serving import OpenAIServing
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
                _, tokens = apply_chat_template(
                    tokenizer,
                    parse_chat_messages(request.messages),
                    request.chat_template,
                    request.add_generation_prompt,
                    request.continue_final_message,
                )
            else:
                _, tokens = self.engine_client.input_processor.tokenize(request.prompt)
                if not request.add_special_tokens:
                    tokens = tokenizer.encode(request.prompt, add_special_tokens=False)
        except (ValueError, TypeError) as e:
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
            return self.create_error_response(
                f"tokens {bad[:5]} are out of the vocabulary: token ids must be in "
                f"[0, {vocab_size - 1}].",
                param="tokens",
            )
        return DetokenizeResponse(prompt=self.engine_client.get_tokenizer().decode(request.tokens))
