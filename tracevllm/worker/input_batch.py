"""The persistent batch: one row per running request, kept across steps.

Mirrors vllm/v1/worker/gpu_input_batch.py (``CachedRequestState``,
``InputBatch``). Consecutive steps mostly serve the same requests, so the
runner keeps their token ids, block tables and sampling knobs in preallocated
rows and only edits what changed: new requests take the lowest free row,
finished ones leave a hole, and ``condense`` moves rows from the end into the
holes so that rows ``0 .. num_reqs-1`` are the batch.

With async scheduling the rows of the last step's samplers hold a
placeholder (-1) for the token each sampled; the tokens themselves stay
on the device in ``prev_sampled_token_ids`` (row ``prev_req_id_to_index[req_id]``).

Left out: bad words, allowed token ids, custom logits processors, prompt
embeddings, spec-decode token ids, LoRA, pooling, multimodal. vLLM
rebuilds ``SamplingMetadata`` only when the batch changed, and hands its
logits processors each change (``BatchUpdate``); here it is rebuilt each
step (a few small tensors), the built-in processors with it, from the rows'
min-tokens, logit bias and min-p.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tracevllm.sample.logits_processor import (
    LogitBiasLogitsProcessor,
    LogitsProcessors,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from tracevllm.sample.metadata import SamplingMetadata
from tracevllm.sampling_params import SamplingParams, SamplingType
from tracevllm.worker.block_table import MultiGroupBlockTable


@dataclass(slots=True)
class CachedRequestState:
    """The runner's record of one request, kept while it is preempted too."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Seeded requests draw their randomness from their own generator.
    generator: torch.Generator | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        vocab_size: int,
        block_sizes: list[int],
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = torch.device(device)

        # Row i is request _req_ids[i]; None marks a hole until condense().
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        # Aliases of each request's CachedRequestState.output_token_ids.
        self.req_output_token_ids: list[list[int] | None] = []
        # Holes left by remove_request, smallest first (vLLM's batch_update_builder.removed).
        self._removed: list[int] = []

        # [max_num_reqs, max_model_len]: prompt then sampled tokens of each row.
        self.token_ids_cpu_tensor = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.num_computed_tokens_cpu = self.num_computed_tokens_cpu_tensor.numpy()

        # One block table per KV cache group (their block sizes).
        self.block_table = MultiGroupBlockTable(
            max_num_reqs, max_model_len, max_num_batched_tokens, device, block_sizes
        )

        # Sampling knobs, one per row.
        self.temperature_cpu = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p_cpu = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k_cpu = np.full(max_num_reqs, vocab_size, dtype=np.int32)
        self.min_p_cpu = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalties_cpu = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalties_cpu = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalties_cpu = np.ones(max_num_reqs, dtype=np.float32)
        self.greedy_reqs: set[str] = set()
        self.random_reqs: set[str] = set()
        self.top_p_reqs: set[str] = set()
        self.top_k_reqs: set[str] = set()
        self.min_p_reqs: set[str] = set()
        self.frequency_penalties_reqs: set[str] = set()
        self.presence_penalties_reqs: set[str] = set()
        self.repetition_penalties_reqs: set[str] = set()
        # row -> generator, only for requests that have a seed.
        self.generators: dict[int, torch.Generator] = {}
        # row -> (min_tokens, stop token ids) of requests with min_tokens > 0.
        self.min_tokens: dict[int, tuple[int, set[int]]] = {}
        # row -> {token id: bias} of requests with a logit_bias.
        self.logit_bias: dict[int, dict[int, float]] = {}
        # req_id -> number of top logprobs asked for.
        self.num_logprobs: dict[str, int] = {}

        # Async scheduling: the last step's sampled tokens ([num_reqs, 1], on
        # the device) and each request's row in it (those that sampled).
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_index: dict[str, int] = {}

    @property
    def req_ids(self) -> list[str]:
        # Holes exist only between remove_request and condense.
        return self._req_ids  # type: ignore[return-value]

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, request: CachedRequestState) -> int:
        """Put a new or resumed request in the lowest free row."""
        req_index = self._removed.pop(0) if self._removed else self.num_reqs
        assert req_index < self.max_num_reqs
        req_id = request.req_id
        if req_index == len(self._req_ids):
            self._req_ids.append(req_id)
            self.req_output_token_ids.append(request.output_token_ids)
        else:
            self._req_ids[req_index] = req_id
            self.req_output_token_ids[req_index] = request.output_token_ids
        self.req_id_to_index[req_id] = req_index

        num_prompt = request.num_prompt_tokens
        self.num_prompt_tokens[req_index] = num_prompt
        self.token_ids_cpu[req_index, :num_prompt] = request.prompt_token_ids
        end = num_prompt + len(request.output_token_ids)
        self.token_ids_cpu[req_index, num_prompt:end] = request.output_token_ids
        self.num_tokens_no_spec[req_index] = request.num_tokens
        self.num_computed_tokens_cpu[req_index] = request.num_computed_tokens
        self.block_table.add_row(request.block_ids, req_index)

        params = request.sampling_params
        if params.sampling_type == SamplingType.GREEDY:
            # 0 marks greedy rows; the sampler never divides by it.
            self.temperature_cpu[req_index] = 0.0
            self.greedy_reqs.add(req_id)
        else:
            self.temperature_cpu[req_index] = params.temperature
            self.random_reqs.add(req_id)
        self.top_p_cpu[req_index] = params.top_p
        if params.top_p < 1.0:
            self.top_p_reqs.add(req_id)
        top_k = params.top_k
        if 0 < top_k < self.vocab_size:
            self.top_k_reqs.add(req_id)
        else:
            top_k = self.vocab_size
        self.top_k_cpu[req_index] = top_k
        self.min_p_cpu[req_index] = params.min_p
        if params.min_p > 0.0:
            self.min_p_reqs.add(req_id)
        self.frequency_penalties_cpu[req_index] = params.frequency_penalty
        if params.frequency_penalty != 0.0:
            self.frequency_penalties_reqs.add(req_id)
        self.presence_penalties_cpu[req_index] = params.presence_penalty
        if params.presence_penalty != 0.0:
            self.presence_penalties_reqs.add(req_id)
        self.repetition_penalties_cpu[req_index] = params.repetition_penalty
        if params.repetition_penalty != 1.0:
            self.repetition_penalties_reqs.add(req_id)
        if params.min_tokens > 0 and params.all_stop_token_ids:
            self.min_tokens[req_index] = (params.min_tokens, set(params.all_stop_token_ids))
        if params.logit_bias:
            self.logit_bias[req_index] = params.logit_bias
        if request.generator is not None:
            self.generators[req_index] = request.generator
        if params.logprobs is not None:
            # -1: every token of the vocabulary, as vLLM.
            self.num_logprobs[req_id] = (
                self.vocab_size if params.logprobs == -1 else params.logprobs
            )
        return req_index

    def remove_request(self, req_id: str) -> int | None:
        """Leave a hole at the request's row; condense() must follow."""
        req_index = self.req_id_to_index.pop(req_id, None)
        if req_index is None:
            return None
        self._removed.append(req_index)
        self._removed.sort()
        self._req_ids[req_index] = None
        self.req_output_token_ids[req_index] = None
        self.block_table.clear_row(req_index)
        for reqs in (
            self.greedy_reqs,
            self.random_reqs,
            self.top_p_reqs,
            self.top_k_reqs,
            self.min_p_reqs,
            self.frequency_penalties_reqs,
            self.presence_penalties_reqs,
            self.repetition_penalties_reqs,
        ):
            reqs.discard(req_id)
        for by_row in self._row_keyed:
            by_row.pop(req_index, None)
        self.num_logprobs.pop(req_id, None)
        # Back in a later step, it comes with its tokens from the scheduler.
        self.prev_req_id_to_index.pop(req_id, None)
        return req_index

    def condense(self) -> None:
        """Fill the holes with the rows at the end, so rows 0..num_reqs-1 are dense.

        Fills the smallest hole from the largest occupied row, as vLLM does,
        so a request's row changes only when a request before it left.
        """
        num_reqs = self.num_reqs
        if num_reqs == 0:
            self._req_ids.clear()
            self.req_output_token_ids.clear()
            self._removed.clear()
            return
        holes = set(self._removed)
        last = len(self._req_ids) - 1
        for empty in self._removed:
            while last in holes:
                last -= 1
            if empty >= last:
                break
            self._move_row(last, empty)
            holes.discard(empty)
            holes.add(last)
            last -= 1
        self._removed.clear()
        del self._req_ids[num_reqs:]
        del self.req_output_token_ids[num_reqs:]

    def _move_row(self, src: int, tgt: int) -> None:
        req_id = self._req_ids[src]
        assert req_id is not None
        self._req_ids[tgt], self._req_ids[src] = req_id, None
        self.req_output_token_ids[tgt] = self.req_output_token_ids[src]
        self.req_output_token_ids[src] = None
        self.req_id_to_index[req_id] = tgt
        n = int(self.num_tokens_no_spec[src])
        self.token_ids_cpu[tgt, :n] = self.token_ids_cpu[src, :n]
        for arr in (
            self.num_tokens_no_spec,
            self.num_prompt_tokens,
            self.num_computed_tokens_cpu,
            self.temperature_cpu,
            self.top_p_cpu,
            self.top_k_cpu,
            self.min_p_cpu,
            self.frequency_penalties_cpu,
            self.presence_penalties_cpu,
            self.repetition_penalties_cpu,
        ):
            arr[tgt] = arr[src]
        self.block_table.move_row(src, tgt)
        for by_row in self._row_keyed:
            if src in by_row:
                by_row[tgt] = by_row.pop(src)

    @property
    def _row_keyed(self) -> tuple[dict[int, Any], ...]:
        """The knobs kept only for the rows that use them, keyed by row: they move with it."""
        return (self.generators, self.min_tokens, self.logit_bias)

    @property
    def all_greedy(self) -> bool:
        return len(self.random_reqs) == 0

    @property
    def all_random(self) -> bool:
        return len(self.greedy_reqs) == 0

    @property
    def no_penalties(self) -> bool:
        return not (
            self.frequency_penalties_reqs
            or self.presence_penalties_reqs
            or self.repetition_penalties_reqs
        )

    @property
    def max_num_logprobs(self) -> int | None:
        return max(self.num_logprobs.values()) if self.num_logprobs else None

    def update_async_output_token_ids(self) -> None:
        """Async scheduling: the last step's tokens for the placeholders that
        end the rows' outputs, before the penalties count them (vLLM's, which
        waits for the copy to the host here)."""
        if self.prev_sampled_token_ids is None or not self.prev_req_id_to_index:
            return
        sampled_token_ids: list[list[int]] | None = None
        for index, req_id in enumerate(self.req_ids):
            prev_index = self.prev_req_id_to_index.get(req_id)
            output_token_ids = self.req_output_token_ids[index]
            if prev_index is None or not output_token_ids or output_token_ids[-1] != -1:
                continue
            if sampled_token_ids is None:
                sampled_token_ids = self.prev_sampled_token_ids.tolist()
            output_token_ids[-1] = sampled_token_ids[prev_index][0]

    def make_sampling_metadata(self) -> SamplingMetadata:
        """Tensors of the first num_reqs rows; None for knobs no request uses."""
        n = self.num_reqs

        def rows(arr: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(arr[:n].copy()).to(self.device)

        no_penalties = self.no_penalties
        return SamplingMetadata(
            temperature=None if self.all_greedy else rows(self.temperature_cpu),
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            top_p=rows(self.top_p_cpu) if self.top_p_reqs else None,
            top_k=rows(self.top_k_cpu) if self.top_k_reqs else None,
            generators=dict(self.generators),
            max_num_logprobs=self.max_num_logprobs,
            no_penalties=no_penalties,
            prompt_token_ids=None if no_penalties else self._make_prompt_token_ids_tensor(),
            frequency_penalties=None if no_penalties else rows(self.frequency_penalties_cpu),
            presence_penalties=None if no_penalties else rows(self.presence_penalties_cpu),
            repetition_penalties=None if no_penalties else rows(self.repetition_penalties_cpu),
            output_token_ids=[] if no_penalties else self.req_output_token_ids[:n],  # type: ignore[arg-type]
            # vLLM's order: min-tokens, logit bias (these two before the
            # penalties), min-p (after the temperature).
            logitsprocs=LogitsProcessors(
                (
                    MinTokensLogitsProcessor(
                        {
                            row: (min_tokens, self.req_output_token_ids[row] or [], stop_ids)
                            for row, (min_tokens, stop_ids) in self.min_tokens.items()
                        },
                        self.device,
                    ),
                    LogitBiasLogitsProcessor(self.logit_bias, self.device),
                    MinPLogitsProcessor(rows(self.min_p_cpu) if self.min_p_reqs else None),
                )
            ),
        )

    def _make_prompt_token_ids_tensor(self) -> torch.Tensor:
        """[num_reqs, longest prompt], int64: each row's prompt, padded with vocab_size."""
        n = self.num_reqs
        max_prompt_len = int(self.num_prompt_tokens[:n].max())
        prompt_token_ids = self.token_ids_cpu[:n, :max_prompt_len].astype(np.int64)
        # vocab_size is no token's id: the penalties count it as nothing.
        pad = np.arange(max_prompt_len)[None, :] >= self.num_prompt_tokens[:n, None]
        prompt_token_ids[pad] = self.vocab_size
        return torch.from_numpy(prompt_token_ids).to(self.device)
