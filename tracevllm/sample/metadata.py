"""What the sampler needs per step, and what it returns.

Mirrors vllm/v1/sample/metadata.py (``SamplingMetadata``) and the tensor types
of vllm/v1/outputs.py (``SamplerOutput``, ``LogprobsTensors``; the plain-list
types the scheduler sees are in tracevllm/outputs.py). Left out:
allowed/bad words, logits processors as objects (min-p is a plain field here, as in
vLLM before logits processors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tracevllm.engine import LogprobsLists


@dataclass(slots=True)
class SamplingMetadata:
    # [num_reqs]; None when every request is greedy. Greedy rows hold 0.
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # [num_reqs] each; None when no request uses the knob.
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    # row -> generator, for seeded requests only.
    generators: dict[int, torch.Generator]
    # None: no logprobs; 0: the sampled token's only.
    max_num_logprobs: int | None
    # Penalties: when no request uses one, nothing below is filled in.
    no_penalties: bool = True
    # [num_reqs, max_prompt_len], int64, padded with vocab_size
    prompt_token_ids: torch.Tensor | None = None
    # [num_reqs] each
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # Per request, its generated tokens (the runner's own lists, not copies).
    output_token_ids: list[list[int]] = field(default_factory=list)
    # row -> (min_tokens, stop token ids), for rows still short of min_tokens
    # (vLLM keeps this state inside its MinTokensLogitsProcessor).
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    # Per request, this step's drafts (speculative decoding): the penalties
    # and min-tokens at a draft position count the drafts before it.
    spec_token_ids: list[list[int]] | None = None


class LogprobsTensors(NamedTuple):
    # [num_reqs, max_num_logprobs + 1], int32: the sampled id, then the top ids.
    logprob_token_ids: torch.Tensor
    # [num_reqs, max_num_logprobs + 1], float32
    logprobs: torch.Tensor
    # [num_reqs], int64: rank of the sampled token (1 = most likely).
    selected_token_ranks: torch.Tensor

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )


@dataclass(slots=True)
class SamplerOutput:
    # [num_reqs, 1], int32: one token per request; with drafts (the rejection
    # sampler) [num_reqs, max_spec_len + 1], -1 after the emitted ones.
    sampled_token_ids: torch.Tensor
    logprobs_tensors: LogprobsTensors | None
