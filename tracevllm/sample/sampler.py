"""Turn one row of logits per request into one token per request.

Mirrors vllm/v1/sample/sampler.py (``Sampler``) with its default
``logprobs_mode="raw_logprobs"``: logprobs are those of the model's raw
distribution, before the logits processors, penalties, temperature and
filtering. The order is vLLM's: float32, the logits processors that can
change a greedy pick (min-tokens, logit bias), the penalties, greedy, the
temperature, the argmax-invariant ones (min-p), top-k/top-p, the draw.
``forward(predict_bonus_token=True)`` samples the bonus token for the
rejection sampler, as vLLM's does: the penalties then count the request's
drafts as generated (and so does min-tokens here; see
logits_processor/builtin.py). Left out: the other logprobs modes (so
``logprobs_mode_override``), logprobs of chosen token ids, allowed/bad words,
the thinking budget.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from tracevllm import tracing
from tracevllm.sample.logits_processor import MinTokensLogitsProcessor
from tracevllm.sample.metadata import LogprobsTensors, SamplerOutput, SamplingMetadata
from tracevllm.sample.ops.argmax import argmax_last_dim
from tracevllm.sample.ops.penalties import apply_all_penalties
from tracevllm.sample.ops.topk_topp_sampler import apply_top_k_top_p, random_sample

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5


class Sampler(nn.Module):
    def __init__(self, logprobs_mode: Literal["raw_logprobs"] = "raw_logprobs") -> None:
        super().__init__()
        if logprobs_mode != "raw_logprobs":
            raise NotImplementedError(f"logprobs_mode {logprobs_mode!r}: tracevllm leaves it out.")
        self.logprobs_mode = logprobs_mode

    # --8<-- [start:sampler_forward]
    @tracing.instrument("Sampler.forward")
    def forward(
        self,
        logits: torch.Tensor,  # [num_reqs, vocab_size], one row per request in batch order
        sampling_metadata: SamplingMetadata,
        predict_bonus_token: bool = False,
    ) -> SamplerOutput:
        num_logprobs = sampling_metadata.max_num_logprobs
        # Logprobs come from the raw logits, before processors, penalties and temperature.
        raw_logprobs = self.compute_logprobs(logits) if num_logprobs is not None else None
        logits = logits.to(torch.float32)
        logits = self.apply_logits_processors(logits, sampling_metadata, predict_bonus_token)
        sampled, _ = self.sample(logits, sampling_metadata)
        sampled = sampled.long()  # [num_reqs]
        logprobs_tensors = None
        if raw_logprobs is not None and num_logprobs is not None:
            logprobs_tensors = self.gather_logprobs(raw_logprobs, num_logprobs, sampled)
        return SamplerOutput(
            sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1),  # [num_reqs, 1]
            logprobs_tensors=logprobs_tensors,
        )

    # --8<-- [end:sampler_forward]

    def apply_logits_processors(
        self,
        logits: torch.Tensor,  # [num_reqs, vocab_size]
        sampling_metadata: SamplingMetadata,
        predict_bonus_token: bool,
    ) -> torch.Tensor:
        """The processors that can change a greedy pick, then the penalties.

        For a bonus token the request's drafts come before it: they count as
        generated tokens.
        """
        md = sampling_metadata
        spec_token_ids = md.spec_token_ids if predict_bonus_token else None
        output_token_ids = md.output_token_ids
        if spec_token_ids is not None and not md.no_penalties:
            output_token_ids = self._combine_outputs_with_spec_tokens(
                output_token_ids, spec_token_ids
            )
        for processor in md.logitsprocs.non_argmax_invariant:
            if spec_token_ids is not None and isinstance(processor, MinTokensLogitsProcessor):
                logits = processor.apply_to_bonus(logits, [len(s) for s in spec_token_ids])
            else:
                logits = processor.apply(logits)
        return self.apply_penalties(logits, md, output_token_ids)

    @staticmethod
    def apply_penalties(
        logits: torch.Tensor,  # [num_reqs, vocab_size]
        sampling_metadata: SamplingMetadata,
        output_token_ids: list[list[int]],
    ) -> torch.Tensor:
        """Repetition, frequency and presence penalties, before any sampling (greedy too)."""
        md = sampling_metadata
        if md.no_penalties:
            return logits
        assert md.prompt_token_ids is not None
        assert md.presence_penalties is not None and md.frequency_penalties is not None
        assert md.repetition_penalties is not None
        return apply_all_penalties(
            logits,
            md.prompt_token_ids,
            md.presence_penalties,
            md.frequency_penalties,
            md.repetition_penalties,
            output_token_ids,
        )

    @staticmethod
    def _combine_outputs_with_spec_tokens(
        output_token_ids: list[list[int]], spec_token_ids: list[list[int]] | None = None
    ) -> list[list[int]]:
        if spec_token_ids is None:
            return output_token_ids
        return [
            [*out, *spec] if spec else out for out, spec in zip(output_token_ids, spec_token_ids)
        ]

    @staticmethod
    def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
        # vLLM's is logits.argmax(dim=-1): the same indices, in two passes on
        # the CPU (sample/ops/argmax.py).
        return argmax_last_dim(logits).view(-1)

    def sample(
        self, logits: torch.Tensor, sampling_metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy rows take the argmax; the others are scaled, filtered and drawn.

        Returns the tokens ([num_reqs]) and, as vLLM's, processed logprobs:
        always None here (the processed-logprobs modes are left out).
        """
        md = sampling_metadata
        assert not (md.all_greedy and md.all_random)
        greedy_sampled = None if md.all_random else self.greedy_sample(logits)
        if md.all_greedy:
            assert greedy_sampled is not None
            return greedy_sampled, None
        assert md.temperature is not None
        logits = self.apply_temperature(logits, md.temperature, md.all_random)
        for processor in md.logitsprocs.argmax_invariant:  # min-p
            logits = processor.apply(logits)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1, dtype=torch.float32)  # [num_reqs, vocab_size]
        random_sampled = random_sample(probs, md.generators)  # [num_reqs]
        if greedy_sampled is None:
            return random_sampled, None
        return torch.where(md.temperature < _SAMPLING_EPS, greedy_sampled, random_sampled), None

    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1, dtype=torch.float32)

    @staticmethod
    def apply_temperature(
        logits: torch.Tensor, temp: torch.Tensor, all_random: bool
    ) -> torch.Tensor:
        if not all_random:
            # Greedy rows hold 0; their random draw is thrown away, avoid inf/nan.
            temp = torch.where(temp < _SAMPLING_EPS, 1.0, temp)
        return logits.div_(temp.unsqueeze(dim=1))

    @staticmethod
    def gather_logprobs(
        logprobs: torch.Tensor,  # [num_tokens, vocab_size]
        num_logprobs: int,
        token_ids: torch.Tensor,  # [num_tokens], int64: the sampled tokens
    ) -> LogprobsTensors:
        """The sampled token's logprob and rank, then the top ``num_logprobs``."""
        assert token_ids.dtype == torch.int64
        topk_logprobs, topk_indices = torch.topk(logprobs, num_logprobs, dim=-1)
        token_ids = token_ids.unsqueeze(-1)  # [num_tokens, 1]
        token_logprobs = logprobs.gather(-1, token_ids)  # [num_tokens, 1]
        # Tokens at least as likely, itself included: rank 1 = the most likely.
        ranks = (logprobs >= token_logprobs).sum(-1)  # [num_tokens]
        indices = torch.cat((token_ids, topk_indices), dim=1)  # [num_tokens, num_logprobs + 1]
        values = torch.cat((token_logprobs, topk_logprobs), dim=1)  # [num_tokens, num_logprobs + 1]
        return LogprobsTensors(indices.to(torch.int32), values, ranks)
