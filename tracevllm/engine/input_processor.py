"""Validate a prompt and its parameters, and make the ``EngineCoreRequest``.

Mirrors vllm/v1/engine/input_processor.py (``InputProcessor.process_inputs``).
Bad input is refused here, at the entry point, with a ``ValueError`` naming
the field and what is allowed, before anything reaches the engine core, so
one bad request never disturbs the others. Left out: multimodal inputs, LoRA,
prompt embeddings, structured-output and pooling validation.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from tracevllm import tracing
from tracevllm.config import VllmConfig
from tracevllm.core.kv_cache_sizing import num_blocks_for_request
from tracevllm.engine import EngineCoreRequest
from tracevllm.sampling_params import SamplingParams
from tracevllm.tracing import records

# str, or {"prompt": str} / {"prompt_token_ids": [...]} (vLLM's TextPrompt / TokensPrompt).
PromptType = str | Mapping[str, Any]


class InputProcessor:
    def __init__(self, vllm_config: VllmConfig, tokenizer: Any) -> None:
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        # Slots a request needs past its tokens, even alone, with speculative
        # decoding. Not its drafts: a request whose drafts do not fit preempts
        # itself and comes back without them, one token further on (as in
        # vLLM). But a draft model's lookahead (k slots) is reserved when a
        # request is admitted too (see Scheduler.schedule).
        spec = vllm_config.speculative_config
        self.num_spec_slots = 0
        if spec is not None and spec.uses_draft_model():
            assert spec.num_speculative_tokens is not None
            self.num_spec_slots = spec.num_speculative_tokens
        self.tokenizer = tokenizer
        # Known once the engine core reported READY (set by LLMEngine).
        self.num_gpu_blocks: int | None = vllm_config.cache_config.num_gpu_blocks
        # Per KV cache group: (block size, most blocks a request holds; 0: no
        # bound), from the engine's READY; None: one full-attention group.
        self.kv_cache_block_limits: list[tuple[int, int]] | None = None
        # The model's stop tokens (and sampling defaults), read once.
        self.generation_config_fields = self.model_config.try_get_generation_config()

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(check_text(prompt, "prompt"))
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise TypeError("prompt_token_ids must be a list of ints.")
                text = prompt.get("prompt")
                return (check_text(text, "prompt") if text is not None else None), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                text = check_text(prompt["prompt"], "prompt")
                return text, self.tokenizer.encode(text)
        raise TypeError(
            "prompt must be a str, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}."
        )

    @staticmethod
    def assign_request_id(request: EngineCoreRequest) -> None:
        """Make the request id unique: the user's id plus 8 random characters.

        As vLLM's: the engine core and the output processor key on the
        internal id, outputs carry the user's (``external_req_id``), so an id
        reused after its request stopped cannot pick up the old one's tokens.
        """
        if request.external_req_id is not None:
            raise ValueError("external_req_id is set by the engine; pass request_id.")
        request.external_req_id = request.request_id
        request.request_id = f"{request.request_id}-{uuid.uuid4().hex[:8]}"

    # --8<-- [start:process_inputs]
    @tracing.instrument("InputProcessor.process_inputs", record=records.process_inputs)
    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """Validate, tokenize, and build the request the core will receive."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}.")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}.")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}.")
        if not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must fit in a signed 64-bit integer, got {priority}.")
        _, prompt_token_ids = self.tokenize(prompt)
        self._validate_prompt(prompt_token_ids)

        # The caller's params are never modified: the request gets its own copy.
        params = params.clone()
        params.verify(self.model_config)
        max_model_len = self.model_config.get_max_model_len()
        if params.max_tokens is None:
            params.max_tokens = max_model_len - len(prompt_token_ids)
        params.update_from_generation_config(
            self.generation_config_fields, self.tokenizer.eos_token_id
        )
        self._validate_fits_kv_cache(len(prompt_token_ids), params.max_tokens)

        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            trace_headers=dict(trace_headers) if trace_headers else None,
        )
        return request

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

        The engine, as vLLM's, refuses to start unless its pool (after
        ``num_gpu_blocks_override``) holds one ``max_model_len`` request
        (kv_cache_sizing.py). That check counts the null block, which no
        request can hold: a pool of exactly ``cdiv(max_model_len, block_size)``
        blocks passes it, yet a request near ``max_model_len`` needs one block
        more than it has. tracevllm's own: this check refuses such a request,
        which would otherwise wait (or preempt itself) forever.
        """
        if self.num_gpu_blocks is None:
            return
        max_len = min(
            num_prompt_tokens + max_tokens + self.num_spec_slots,
            self.model_config.get_max_model_len(),
        )
        # A sliding window's group holds a bounded number of blocks; with
        # several groups (Gemma-2), a request holds blocks in each.
        limits = self.kv_cache_block_limits or [(self.cache_config.block_size, 0)]
        needed = num_blocks_for_request(limits, max_len)
        usable = self.num_gpu_blocks - 1  # block 0 is the null block
        if needed > usable:
            lookahead = f" + {self.num_spec_slots} draft-model slots" if self.num_spec_slots else ""
            raise ValueError(
                f"The request needs up to {needed} KV cache blocks ({num_prompt_tokens} "
                f"prompt tokens + max_tokens={max_tokens}{lookahead}, block_size="
                f"{self.cache_config.block_size}) but the cache has only {usable}. "
                "Lower max_tokens or the prompt length, or give the cache more blocks "
                "(num_gpu_blocks_override / kv_cache_memory_bytes)."
            )


def request_prompt_text(prompt: PromptType) -> str | None:
    """The prompt's text, if it has one (vLLM's ``extract_prompt_components``)."""
    return prompt if isinstance(prompt, str) else prompt.get("prompt")


def check_text(text: Any, name: str) -> str:
    """A str the tokenizer can take: UTF-8, so no lone surrogate (e.g. "\\ud800")."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} is not valid Unicode text: {e.reason} at position {e.start} "
            f"({text[e.start : e.end]!r}). Remove or replace that character."
        ) from None
    return text
