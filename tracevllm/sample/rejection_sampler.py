"""Verify a step's draft tokens against the target model: accept, reject, recover.

Mirrors vllm/v1/sample/rejection_sampler.py (``RejectionSampler``,
``rejection_sample``, ``apply_sampling_constraints``,
``generate_uniform_probs``, ``sample_recovered_tokens``), after Leviathan et
al., https://arxiv.org/abs/2211.17192. The target model ran once over each
request's last token and its k drafts, so it has a distribution p at every
draft position and one past the last (the bonus position). Draft i is kept
while every draft before it was kept and

- greedy: it is p's argmax;
- random: ``u < p(draft) / q(draft)``, u uniform, q the draft's own
  distribution (an n-gram draft has none: q is 1 on the draft).

The first rejected draft is replaced by a *recovered* token drawn from
``norm(max(p - q, 0))``; if all k are kept, the bonus token, drawn from p at
the bonus position, follows. Either way each request emits between 1 and
k + 1 tokens, distributed exactly as sampling from p one token at a time.

vLLM runs the acceptance rule as Triton kernels, one program per request;
tracevllm runs ``accept_draft_tokens`` per request on small Python lists
(lab 12 rewrites it). Each position sees its own past: min-tokens and the
penalties count the drafts before it. tracevllm also applies min-p at every
position (vLLM 0.22 refuses min-p with speculative decoding). Left out:
synthetic acceptance rates, bad words, allowed token ids, the
processed-logprobs modes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from tracevllm import tracing
from tracevllm.engine import LogprobsLists
from tracevllm.labs import lab_hook
from tracevllm.sample.metadata import LogprobsTensors, SamplerOutput, SamplingMetadata
from tracevllm.sample.ops.topk_topp_sampler import apply_top_k_top_p
from tracevllm.sample.sampler import Sampler
from tracevllm.spec_decode.metadata import SpecDecodeMetadata
from tracevllm.tracing import records

# A rejected position of the output (vLLM's PLACEHOLDER_TOKEN_ID).
PLACEHOLDER_TOKEN_ID = -1
# What a greedy request's temperature reads in the batch.
GREEDY_TEMPERATURE = 0.0


class RejectionSampler(nn.Module):
    def __init__(self, sampler: Sampler) -> None:
        super().__init__()
        self.sampler = sampler

    # --8<-- [start:rejection_sampler_forward]
    @tracing.instrument("RejectionSampler.forward", record=records.rejection_sample)
    def forward(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,  # [num_draft_tokens, vocab_size]; None: no q
        logits: torch.Tensor,  # [num_draft_tokens + batch_size, vocab_size]
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        """``logits`` holds, per request, a row for each draft position then
        one for the bonus. Returns [batch_size, max_spec_len + 1] token ids,
        -1 after the first rejection."""
        num_logprobs = sampling_metadata.max_num_logprobs
        raw_logprobs = self.sampler.compute_logprobs(logits) if num_logprobs is not None else None
        logits = logits.to(torch.float32)
        logits = self.apply_logits_processors(logits, sampling_metadata, metadata)
        # Fancy indexing copies: the two can be changed in place apart.
        bonus_logits = logits[metadata.bonus_logits_indices]  # [batch_size, vocab_size]
        target_logits = logits[metadata.target_logits_indices]  # [num_draft_tokens, vocab_size]
        # The bonus token is sampled as any other token, with every knob.
        bonus_token_ids = self.sampler.sample(bonus_logits, sampling_metadata)  # [batch_size]
        target_logits = apply_sampling_constraints(
            target_logits, metadata.num_draft_tokens, sampling_metadata
        )
        output_token_ids = rejection_sample(
            metadata.draft_token_ids,
            metadata.num_draft_tokens,
            metadata.max_spec_len,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
        )
        logprobs_tensors = None
        if raw_logprobs is not None and num_logprobs is not None:
            logprobs_tensors = self._get_logprobs_tensors(
                num_logprobs, metadata, raw_logprobs, output_token_ids
            )
        return SamplerOutput(output_token_ids, logprobs_tensors)

    # --8<-- [end:rejection_sampler_forward]

    def apply_logits_processors(
        self,
        logits: torch.Tensor,  # [num_draft_tokens + batch_size, vocab_size]
        sampling_metadata: SamplingMetadata,
        metadata: SpecDecodeMetadata,
    ) -> torch.Tensor:
        """Min-tokens and the penalties, each row with its own past: the
        request's outputs and the drafts before that position."""
        md = sampling_metadata
        if not md.min_tokens and md.no_penalties:
            return logits
        num_sampled = [n + 1 for n in metadata.num_draft_tokens]
        # [num_draft_tokens + batch_size]: the request of each row.
        repeat_indices = np.repeat(np.arange(len(num_sampled)), num_sampled)
        row_positions = np.concatenate([np.arange(n) for n in num_sampled])
        spec_token_ids = md.spec_token_ids or [[] for _ in num_sampled]
        # Row -> (min_tokens, stop ids), for rows still short of min_tokens.
        min_tokens = {}
        for row, (req, pos) in enumerate(zip(repeat_indices.tolist(), row_positions.tolist())):
            if req in md.min_tokens:
                num_min, stop_ids = md.min_tokens[req]
                if len(md.output_token_ids[req]) + pos < num_min:
                    min_tokens[row] = (num_min, stop_ids)
        expanded = dataclasses.replace(md, min_tokens=min_tokens)
        if not md.no_penalties:
            index = torch.from_numpy(repeat_indices).to(logits.device)
            assert md.prompt_token_ids is not None
            assert md.frequency_penalties is not None and md.presence_penalties is not None
            assert md.repetition_penalties is not None
            expanded = dataclasses.replace(
                expanded,
                prompt_token_ids=md.prompt_token_ids[index],
                frequency_penalties=md.frequency_penalties[index],
                presence_penalties=md.presence_penalties[index],
                repetition_penalties=md.repetition_penalties[index],
                output_token_ids=[
                    md.output_token_ids[req] + spec_token_ids[req][:pos]
                    for req, pos in zip(repeat_indices.tolist(), row_positions.tolist())
                ],
            )
        logits = self.sampler.apply_min_tokens(logits, expanded)
        return self.sampler.apply_penalties(logits, expanded)

    def _get_logprobs_tensors(
        self,
        num_logprobs: int,
        metadata: SpecDecodeMetadata,
        raw_logprobs: torch.Tensor,  # [num_draft_tokens + batch_size, vocab_size]
        output_token_ids: torch.Tensor,  # [batch_size, max_spec_len + 1]
    ) -> LogprobsTensors:
        """Logprobs of every row's token; rejected positions (token 0 here)
        are dropped by ``parse_output``."""
        tokens = [
            row[: n + 1] for row, n in zip(output_token_ids.tolist(), metadata.num_draft_tokens)
        ]
        token_ids = torch.tensor([max(t, 0) for row in tokens for t in row], dtype=torch.int64)
        return self.sampler.gather_logprobs(raw_logprobs, num_logprobs, token_ids)

    @staticmethod
    def parse_output(
        output_token_ids: torch.Tensor,  # [batch_size, max_spec_len + 1]
        num_draft_tokens: list[int],
        discard_req_indices: Sequence[int] = (),
        logprobs_tensors: LogprobsTensors | None = None,
    ) -> tuple[list[list[int]], LogprobsLists | None]:
        """Each request's emitted tokens (placeholders dropped; none for a
        discarded row), and the logprobs of the emitted ones."""
        outputs = [
            [t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in output_token_ids.tolist()
        ]
        logprobs_lists = None
        if logprobs_tensors is not None:
            # One row per position each request could emit; keep the emitted.
            valid = [
                i < len(out) for out, n in zip(outputs, num_draft_tokens) for i in range(n + 1)
            ]
            lists = logprobs_tensors.tolists()
            keep = [i for i, v in enumerate(valid) if v]
            logprobs_lists = LogprobsLists(
                [lists.logprob_token_ids[i] for i in keep],
                [lists.logprobs[i] for i in keep],
                [lists.sampled_token_ranks[i] for i in keep],
                cu_num_generated_tokens=[0, *np.cumsum([len(o) for o in outputs]).tolist()],
            )
        for i in discard_req_indices:
            outputs[i] = []
        return outputs, logprobs_lists


# --8<-- [start:rejection_sample]
def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens], int32
    num_draft_tokens: list[int],  # [batch_size]
    max_spec_len: int,
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, vocab_size]
    target_logits: torch.Tensor,  # [num_draft_tokens, vocab_size], after temperature/top-k/top-p
    bonus_token_ids: torch.Tensor,  # [batch_size]
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """[batch_size, max_spec_len + 1]: each request's emitted tokens, then -1s."""
    batch_size = len(num_draft_tokens)
    md = sampling_metadata
    if md.all_greedy:
        is_greedy = [True] * batch_size
    else:
        assert md.temperature is not None
        is_greedy = (md.temperature == GREEDY_TEMPERATURE).tolist()
    draft_ids = draft_token_ids.tolist()
    target_argmax = target_logits.argmax(dim=-1).tolist()
    target_p = draft_q = uniform = recovered = None
    if not md.all_greedy:
        uniform_probs = generate_uniform_probs(len(draft_ids), num_draft_tokens, md.generators)
        target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
        recovered_token_ids = sample_recovered_tokens(
            num_draft_tokens, draft_token_ids, draft_probs, target_probs, md
        )
        # The acceptance rule reads only p and q at the draft token.
        index = draft_token_ids.to(torch.int64).unsqueeze(1)  # [num_draft_tokens, 1]
        target_p = target_probs.gather(1, index).squeeze(1).tolist()
        if draft_probs is not None:
            draft_q = draft_probs.gather(1, index).squeeze(1).tolist()
        uniform = uniform_probs.tolist()
        recovered = recovered_token_ids.tolist()

    output_token_ids = torch.full(
        (batch_size, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32
    )
    bonus = bonus_token_ids.tolist()
    start = 0
    for req, n in enumerate(num_draft_tokens):
        end = start + n
        greedy = is_greedy[req]
        tokens = accept_draft_tokens(
            draft_ids[start:end],
            bonus[req],
            greedy,
            target_argmax[start:end],
            None if greedy or target_p is None else target_p[start:end],
            None if greedy or draft_q is None else draft_q[start:end],
            None if greedy or uniform is None else uniform[start:end],
            None if greedy or recovered is None else recovered[start:end],
        )
        output_token_ids[req, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        start = end
    return output_token_ids.to(target_logits.device)


# --8<-- [end:rejection_sample]


# --8<-- [start:accept_draft_tokens]
@lab_hook("accept_draft_tokens")  # lab 12: chapters/12-rejection-sampling
def accept_draft_tokens(
    draft_token_ids: list[int],  # the request's k drafts
    bonus_token_id: int,  # sampled from p after the last draft
    is_greedy: bool,
    target_argmax: list[int],  # greedy: p's argmax at each draft position
    target_probs: list[float] | None,  # random: p(draft) at each position
    draft_probs: list[float] | None,  # random: q(draft); None: an n-gram draft (q = 1)
    uniform_probs: list[float] | None,  # random: u ~ U[0, 1) per position
    recovered_token_ids: list[int] | None,  # random: drawn from norm(max(p - q, 0))
) -> list[int]:
    """One request's emitted tokens: its accepted drafts, then one more.

    vLLM's ``rejection_greedy_sample_kernel`` and
    ``rejection_random_sample_kernel``, for one request.
    """
    output: list[int] = []
    for pos, draft in enumerate(draft_token_ids):
        if is_greedy:
            # The target's own pick goes out either way; it ends the run if it differs.
            output.append(target_argmax[pos])
            if draft != target_argmax[pos]:
                return output
            continue
        assert target_probs is not None and uniform_probs is not None
        assert recovered_token_ids is not None
        q = 1.0 if draft_probs is None else draft_probs[pos]
        # q is never 0 for a token the draft drew; if it is, reject (no NaN).
        if q > 0 and target_probs[pos] / q >= uniform_probs[pos]:
            output.append(draft)
        else:
            output.append(recovered_token_ids[pos])
            return output
    output.append(bonus_token_id)
    return output


# --8<-- [end:accept_draft_tokens]


def apply_sampling_constraints(
    logits: torch.Tensor,  # [num_draft_tokens, vocab_size]
    num_draft_tokens: list[int],  # [batch_size]
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p at every draft position, with its
    request's values (greedy requests: unchanged, their argmax decides)."""
    md = sampling_metadata
    if md.all_greedy:
        return logits
    assert md.temperature is not None
    temperature = expand_batch_to_tokens(md.temperature, num_draft_tokens)
    temperature = torch.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature)
    logits.div_(temperature.unsqueeze(-1))
    if md.min_p is not None:
        logits = Sampler.apply_min_p(logits, expand_batch_to_tokens(md.min_p, num_draft_tokens))
    top_k = None if md.top_k is None else expand_batch_to_tokens(md.top_k, num_draft_tokens)
    top_p = None if md.top_p is None else expand_batch_to_tokens(md.top_p, num_draft_tokens)
    return apply_top_k_top_p(logits, top_k, top_p)


def expand_batch_to_tokens(x: torch.Tensor, num_tokens: list[int]) -> torch.Tensor:
    """[a, b, c] with [2, 3, 1] tokens -> [a, a, b, b, b, c]."""
    return x.repeat_interleave(torch.tensor(num_tokens, device=x.device))


def generate_uniform_probs(
    num_tokens: int, num_draft_tokens: list[int], generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """[num_tokens], float64 (float32 can draw exactly 0): one u per draft.

    A seeded request draws its own from its generator, and a request without
    drafts draws nothing, so its stream does not depend on the batch.
    """
    uniform_probs = torch.rand(num_tokens, dtype=torch.float64)
    start = 0
    for req, n in enumerate(num_draft_tokens):
        if n and (generator := generators.get(req)) is not None:
            uniform_probs[start : start + n].uniform_(generator=generator)
        start += n
    return uniform_probs


def sample_recovered_tokens(
    num_draft_tokens: list[int],
    draft_token_ids: torch.Tensor,  # [num_draft_tokens]
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, vocab_size]
    target_probs: torch.Tensor,  # [num_draft_tokens, vocab_size]
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """[num_draft_tokens]: at each position, a draw from norm(max(p - q, 0)).

    Only the first rejected position's draw is ever used, so each request
    shares one exponential-race noise row across its positions (as vLLM).
    Without q the draft token is simply taken out of p.
    """
    batch_size, vocab_size = len(num_draft_tokens), target_probs.shape[-1]
    q = torch.empty(batch_size, vocab_size, dtype=torch.float32, device=target_probs.device)
    q.exponential_()
    for req, generator in sampling_metadata.generators.items():
        if num_draft_tokens[req] > 0:
            q[req].exponential_(generator=generator)
    inv_q = q.reciprocal()
    if draft_probs is None:
        rows = torch.arange(len(draft_token_ids), device=target_probs.device)
        prob = target_probs.clone()
        prob[rows, draft_token_ids.to(torch.int64)] = 0.0
    else:
        prob = (target_probs - draft_probs).clamp_min_(0.0)
    req_of_token = torch.tensor(num_draft_tokens, device=prob.device)
    req_of_token = torch.arange(batch_size, device=prob.device).repeat_interleave(req_of_token)
    # argmax(prob / E) is a draw from prob / sum(prob): no need to normalize.
    return (prob * inv_q[req_of_token]).argmax(dim=-1)
