"""Validate a prompt and its parameters, and make the ``EngineCoreRequest``.

Mirrors vllm/v1/engine/input_processor.py (``InputProcessor.process_inputs``).
Bad input is refused here, at the entry point, with a ``ValueError`` naming
the field and what is allowed, before anything reaches the engine core, so
one bad request never disturbs the others. Left out: multimodal inputs, LoRA,
prompt embeddings, structured-output and pooling validation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from tracevllm import tracing
from tracevllm.config import VllmConfig
from tracevllm.core.kv_cache_manager import cdiv
from tracevllm.engine import EngineCoreRequest
from tracevllm.sampling_params import SamplingParams

# str, or {"prompt": str} / {"prompt_token_ids": [...]} (vLLM's TextPrompt / TokensPrompt).
PromptType = str | Mapping[str, Any]


class InputProcessor:
    def __init__(self, vllm_config: VllmConfig, tokenizer: Any) -> None:
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.tokenizer = tokenizer
        # Known once the engine core reported READY (set by LLMEngine).
        self.num_gpu_blocks: int | None = vllm_config.cache_config.num_gpu_blocks

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise ValueError("prompt_token_ids must be a list of ints.")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError(
            "prompt must be a str, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}."
        )

    # --8<-- [start:process_inputs]
    @tracing.instrument("InputProcessor.process_inputs")
    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Validate, tokenize, and build the request the core will receive."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}.")
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        self._validate_prompt(prompt_token_ids)

        # The caller's params are never modified: the request gets its own copy.
        params = params.clone()
        max_model_len = self.model_config.get_max_model_len()
        if params.max_tokens is None:
            params.max_tokens = max_model_len - len(prompt_token_ids)
        params.update_from_tokenizer(self.tokenizer.eos_token_id)
        self._validate_fits_kv_cache(len(prompt_token_ids), params.max_tokens)

        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            trace_headers=dict(trace_headers) if trace_headers else None,
        )
        span = tracing.current_span()
        if span.is_recording():
            span.set_attribute("tracevllm.prompt_token_ids", prompt_token_ids)
            span.set_attribute("tracevllm.max_tokens", params.max_tokens)
        return prompt_text, request

    # --8<-- [end:process_inputs]

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("The decoder prompt cannot be empty.")
        max_model_len = self.model_config.get_max_model_len()
        if len(prompt_token_ids) > max_model_len - 1:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the "
                f"maximum model length of {max_model_len} minus one token to generate. "
                "Make sure that `max_model_len` is no smaller than the number of text "
                "tokens plus one."
            )
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"Token id {bad[0]} is out of vocabulary: prompt token ids must be in "
                f"[0, {vocab_size - 1}]."
            )

    def _validate_fits_kv_cache(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request that could never be scheduled, even alone.

        vLLM checks at start-up that one max_model_len request fits; with a
        small ``num_gpu_blocks_override`` the check has to be per request, or
        the request would wait (or preempt itself) forever.
        """
        if self.num_gpu_blocks is None:
            return
        max_len = min(num_prompt_tokens + max_tokens, self.model_config.get_max_model_len())
        needed = cdiv(max_len, self.cache_config.block_size)
        usable = self.num_gpu_blocks - 1  # block 0 is the null block
        if needed > usable:
            raise ValueError(
                f"The request needs up to {needed} KV cache blocks ({num_prompt_tokens} "
                f"prompt tokens + max_tokens={max_tokens}, block_size="
                f"{self.cache_config.block_size}) but the cache has only {usable}. "
                "Lower max_tokens or the prompt length, or give the cache more blocks "
                "(num_gpu_blocks_override / kv_cache_memory_bytes)."
            )
