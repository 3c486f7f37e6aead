"""Turn one row of logits per request into one token per request.

Mirrors vllm/v1/sample/sampler.py (``Sampler``) with its default
``logprobs_mode="raw_logprobs"``: logprobs are those of the model's raw
distribution, before penalties, temperature and filtering. vLLM's two
built-in logits processors that can change a greedy pick are plain steps
here: min-tokens (``apply_min_tokens``) and min-p (in ``sample``). Left out:
logit bias, allowed/bad words, custom logits processors, prompt logprobs,
the rejection sampler.
"""

from __future__ import annotations

import torch
from torch import nn

from tracevllm import tracing
from tracevllm.sample.metadata import LogprobsTensors, SamplerOutput, SamplingMetadata
from tracevllm.sample.ops.penalties import apply_all_penalties
from tracevllm.sample.ops.topk_topp_sampler import apply_top_k_top_p, random_sample

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5


class Sampler(nn.Module):
    # --8<-- [start:sampler_forward]
    @tracing.instrument("Sampler.forward")
    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """``logits``: [num_reqs, vocab_size], one row per request in batch order."""
        num_logprobs = sampling_metadata.max_num_logprobs
        # Logprobs come from the raw logits, before penalties, temperature and filtering.
        raw_logprobs = self.compute_logprobs(logits) if num_logprobs is not None else None
        logits = logits.to(torch.float32)
        # vLLM's non-argmax-invariant logits processors (here min-tokens), then penalties.
        logits = self.apply_min_tokens(logits, sampling_metadata)
        logits = self.apply_penalties(logits, sampling_metadata)
        sampled = self.sample(logits, sampling_metadata)  # [num_reqs], int64
        logprobs_tensors = None
        if raw_logprobs is not None and num_logprobs is not None:
            logprobs_tensors = self.gather_logprobs(raw_logprobs, num_logprobs, sampled)
        return SamplerOutput(
            sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1),  # [num_reqs, 1]
            logprobs_tensors=logprobs_tensors,
        )

    # --8<-- [end:sampler_forward]

    @staticmethod
    def apply_min_tokens(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        """Forbid stop tokens (EOS included) to a request still short of ``min_tokens``.

        vLLM's ``MinTokensLogitsProcessor.apply``: their logits become -inf, so
        not even greedy can pick them, and the request runs on.
        """
        if not sampling_metadata.min_tokens:
            return logits
        rows: list[int] = []
        token_ids: list[int] = []
        for row, (_, stop_token_ids) in sampling_metadata.min_tokens.items():
            rows += [row] * len(stop_token_ids)
            token_ids += stop_token_ids
        index = (
            torch.tensor(rows, device=logits.device),
            torch.tensor(token_ids, device=logits.device),
        )
        return logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))

    @staticmethod
    def apply_penalties(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
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
            md.output_token_ids,
        )

    def sample(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; the others are scaled, filtered and drawn."""
        md = sampling_metadata
        greedy_sampled = None if md.all_random else logits.argmax(dim=-1).view(-1)
        if md.all_greedy:
            assert greedy_sampled is not None
            return greedy_sampled
        assert md.temperature is not None
        logits = self.apply_temperature(logits, md.temperature, md.all_random)
        if md.min_p is not None:
            logits = self.apply_min_p(logits, md.min_p)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1, dtype=torch.float32)  # [num_reqs, vocab_size]
        random_sampled = random_sample(probs, md.generators)  # [num_reqs]
        if greedy_sampled is None:
            return random_sampled
        return torch.where(md.temperature < _SAMPLING_EPS, greedy_sampled, random_sampled)

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
    def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """Drop tokens whose probability is below ``min_p`` times the top one's."""
        probs = logits.softmax(dim=-1)  # [num_reqs, vocab_size]
        max_probs = probs.amax(dim=-1, keepdim=True)  # [num_reqs, 1]
        return logits.masked_fill_(probs < max_probs * min_p.unsqueeze(1), float("-inf"))

    @staticmethod
    def gather_logprobs(
        logprobs: torch.Tensor,  # [num_reqs, vocab_size]
        num_logprobs: int,
        token_ids: torch.Tensor,  # [num_reqs], int64: the sampled tokens
    ) -> LogprobsTensors:
        """The sampled token's logprob and rank, then the top ``num_logprobs``."""
        topk_logprobs, topk_indices = torch.topk(logprobs, num_logprobs, dim=-1)
        token_ids = token_ids.unsqueeze(-1)  # [num_reqs, 1]
        token_logprobs = logprobs.gather(-1, token_ids)  # [num_reqs, 1]
        # Tokens at least as likely, itself included: rank 1 = the most likely.
        ranks = (logprobs >= token_logprobs).sum(-1)  # [num_reqs]
        indices = torch.cat((token_ids, topk_indices), dim=1)  # [num_reqs, num_logprobs + 1]
        values = torch.cat((token_logprobs, topk_logprobs), dim=1)  # [num_reqs, num_logprobs + 1]
        return LogprobsTensors(indices.to(torch.int32), values, ranks)
