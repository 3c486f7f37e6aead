"""What the sampler needs per step, and what it returns.

Mirrors vllm/v1/sample/metadata.py (``SamplingMetadata``) and the tensor types
of vllm/v1/outputs.py (``SamplerOutput``, ``LogprobsTensors``; the plain-list
types the scheduler sees are in tracevllm/outputs.py). The fields and their
order are vLLM 0.22.0's, so code that builds one for vLLM builds one here.
Left out: allowed token ids, bad words and logprobs of chosen token ids (the
fields are kept, and must stay empty), the thinking budget; of the logits
processors, the custom ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tracevllm.engine import LogprobsLists
from tracevllm.sample.logits_processor import LogitsProcessors


@dataclass(slots=True)
class SamplingMetadata:
    # [num_reqs]; None when every request is greedy. Greedy rows hold 0.
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # [num_reqs] each; None when no request uses the knob.
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
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
    # Left out (vLLM's allowed_token_ids / bad_words): None and {} only.
    allowed_token_ids_mask: torch.Tensor | None = None
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    # Min-tokens and logit bias (before the penalties, greedy rows too), then
    # min-p (after the temperature): vLLM's built-in processors.
    logitsprocs: LogitsProcessors = field(default_factory=LogitsProcessors)
    # Left out (vLLM's generative-scoring logprobs): None only.
    logprob_token_ids: dict[int, list[int]] | None = None
    # Per request, this step's drafts (speculative decoding): the penalties
    # and min-tokens at a draft position count the drafts before it.
    spec_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        # Code written for vLLM may fill these in; silently ignoring them
        # would sample something else than it asked for.
        for name in ("allowed_token_ids_mask", "bad_words_token_ids", "logprob_token_ids"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, dict) or value):
                raise NotImplementedError(f"SamplingMetadata.{name}: tracevllm leaves it out.")


class LogprobsTensors(NamedTuple):
    # [num_reqs, max_num_logprobs + 1], int32: the sampled id, then the top ids.
    logprob_token_ids: torch.Tensor
    # [num_reqs, max_num_logprobs + 1], float32
    logprobs: torch.Tensor
    # [num_reqs], int64: rank of the sampled token (1 = most likely).
    selected_token_ranks: torch.Tensor

    def tolists(self, cu_num_generated_tokens: list[int] | None = None) -> LogprobsLists:
        return LogprobsLists(
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
            cu_num_generated_tokens,
        )

    def filter(self, mask: torch.Tensor) -> LogprobsTensors:
        """The rows where ``mask`` ([num_rows], bool) is True."""
        return LogprobsTensors(
            self.logprob_token_ids[mask], self.logprobs[mask], self.selected_token_ranks[mask]
        )


@dataclass(slots=True)
class SamplerOutput:
    # [num_reqs, 1], int32: one token per request; with drafts (the rejection
    # sampler) [num_reqs, max_spec_len + 1], -1 after the emitted ones.
    sampled_token_ids: torch.Tensor
    logprobs_tensors: LogprobsTensors | None
