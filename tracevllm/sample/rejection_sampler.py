"""Verify a step's draft tokens against the target model: accept, reject, recover.

Mirrors vllm/v1/sample/rejection_sampler.py (``RejectionSampler``,
``rejection_sample``, ``apply_sampling_constraints``,
``expand_batch_to_tokens``, ``generate_uniform_probs``,
``sample_recovered_tokens``, with vLLM's signatures), after Leviathan et
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
As in vLLM, the bonus token comes from the plain ``Sampler``
(``predict_bonus_token=True``), with every knob.

vLLM runs the acceptance rule as Triton kernels, one program per request;
tracevllm runs ``accept_draft_tokens`` per request on small Python lists
(lab 12 rewrites it). Each position sees its own past: min-tokens and the
penalties count the drafts before it. tracevllm also applies min-p and logit
bias at every position (vLLM 0.22 refuses both with speculative decoding).
Left out: synthetic acceptance rates, bad words, allowed token ids, the
processed-logprobs modes, the thinking budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from tracevllm import tracing
from tracevllm.engine import LogprobsLists
from tracevllm.labs import lab_hook
from tracevllm.sample.metadata import LogprobsTensors, SamplerOutput, SamplingMetadata
from tracevllm.sample.ops.argmax import argmax_last_dim
from tracevllm.sample.ops.penalties import apply_all_penalties
from tracevllm.sample.ops.topk_topp_sampler import apply_top_k_top_p
from tracevllm.sample.sampler import Sampler
from tracevllm.spec_decode.metadata import SpecDecodeMetadata
from tracevllm.tracing import records

# A rejected position of the output (vLLM's PLACEHOLDER_TOKEN_ID).
PLACEHOLDER_TOKEN_ID = -1
# What a greedy request's temperature reads in the batch.
GREEDY_TEMPERATURE = 0.0
# Most drafts a request may have in one step (vLLM's MAX_SPEC_LEN).
MAX_SPEC_LEN = 128


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
        assert metadata.max_spec_len <= MAX_SPEC_LEN
        # Fancy indexing copies: the bonus and target rows change apart, and
        # ``logits`` stays raw for the logprobs.
        bonus_logits = logits[metadata.bonus_logits_indices]  # [batch_size, vocab_size]
        bonus_sampler_output = self.sampler(
            logits=bonus_logits,
            sampling_metadata=dataclasses.replace(sampling_metadata, max_num_logprobs=None),
            predict_bonus_token=True,
        )
        bonus_token_ids = bonus_sampler_output.sampled_token_ids  # [batch_size, 1]
        # [num_draft_tokens, vocab_size]
        target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)
        target_logits = apply_sampling_constraints(
            target_logits, metadata.cu_num_draft_tokens, sampling_metadata
        )
        output_token_ids = rejection_sample(
            metadata.draft_token_ids,
            metadata.num_draft_tokens,
            metadata.max_spec_len,
            metadata.cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
        )
        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs, metadata, logits, output_token_ids
            )
        return SamplerOutput(output_token_ids, logprobs_tensors)

    # --8<-- [end:rejection_sampler_forward]

    def _get_logprobs_tensors(
        self,
        max_num_logprobs: int,
        metadata: SpecDecodeMetadata,
        logits: torch.Tensor,  # [num_draft_tokens + batch_size, vocab_size], raw
        sampled_token_ids: torch.Tensor,  # [batch_size, max_spec_len + 1]
    ) -> LogprobsTensors:
        """Raw logprobs at every position a request could emit, [batch_size *
        (max_spec_len + 1)] rows; ``parse_output`` keeps the emitted ones.
        (vLLM passes the target and bonus logits apart, for its processed
        modes; raw, they are the rows of ``logits``.)"""
        cu_num_sampled_tokens = metadata.cu_num_sampled_tokens
        starts = torch.zeros_like(cu_num_sampled_tokens)  # [batch_size]: a request's first row
        starts[1:] = cu_num_sampled_tokens[:-1]
        offsets = torch.arange(
            sampled_token_ids.shape[-1], device=starts.device, dtype=starts.dtype
        )
        # A position past a request's rows reads a neighbour's: it is -1, and dropped.
        rows = (starts.unsqueeze(1) + offsets.unsqueeze(0)).flatten().clamp_(max=len(logits) - 1)
        token_ids = sampled_token_ids.flatten().clone()
        token_ids[token_ids == PLACEHOLDER_TOKEN_ID] = 0  # any id: dropped too
        logprobs = self.sampler.compute_logprobs(logits[rows])
        return self.sampler.gather_logprobs(logprobs, max_num_logprobs, token_ids.to(torch.int64))

    @staticmethod
    def parse_output(
        output_token_ids: torch.Tensor,  # [batch_size, max_spec_len + 1]
        vocab_size: int,
        discard_req_indices: Sequence[int] = (),
        logprobs_tensors: LogprobsTensors | None = None,
    ) -> tuple[list[list[int]], LogprobsLists | None]:
        """Each request's emitted tokens (placeholders dropped; none for a
        discarded row), and the logprobs of the emitted ones."""
        output_token_ids_np = output_token_ids.cpu().numpy()
        valid_mask = (output_token_ids_np != PLACEHOLDER_TOKEN_ID) & (
            output_token_ids_np < vocab_size
        )
        output_logprobs = None
        if logprobs_tensors is not None:
            cu_num_tokens = [0, *valid_mask.sum(axis=1).cumsum().tolist()]
            mask = torch.from_numpy(valid_mask.flatten()).to(logprobs_tensors.logprobs.device)
            output_logprobs = logprobs_tensors.filter(mask).tolists(cu_num_tokens)
        if len(discard_req_indices) > 0:
            valid_mask[list(discard_req_indices)] = False
        outputs = [row[valid_mask[i]].tolist() for i, row in enumerate(output_token_ids_np)]
        return outputs, output_logprobs

    def apply_logits_processors(
        self,
        logits: torch.Tensor,  # [num_draft_tokens, vocab_size]
        sampling_metadata: SamplingMetadata,
        metadata: SpecDecodeMetadata,
    ) -> torch.Tensor:
        """Min-tokens, logit bias, then the penalties, at each draft position
        with its own past: the request's outputs and the drafts before it.

        In the plain sampler's order (vLLM runs the penalties first here, and
        no logit bias): a bias before a repetition penalty is not the same
        as after it.
        """
        md = sampling_metadata
        for processor in md.logitsprocs.non_argmax_invariant:
            logits = processor.apply_with_spec_decode(logits, metadata.num_draft_tokens)
        if md.no_penalties:
            return logits
        assert md.spec_token_ids is not None, "the penalties need each request's drafts"
        output_token_ids = self._combine_outputs_with_spec_tokens(
            md.output_token_ids, md.spec_token_ids
        )
        # [num_draft_tokens]: the request of each row.
        repeat_indices = torch.arange(len(metadata.num_draft_tokens)).repeat_interleave(
            torch.tensor(metadata.num_draft_tokens)
        )
        return self.apply_penalties(
            logits, md, metadata, repeat_indices.to(logits.device), output_token_ids
        )

    @staticmethod
    def apply_penalties(
        logits: torch.Tensor,  # [num_draft_tokens, vocab_size]
        sampling_metadata: SamplingMetadata,
        metadata: SpecDecodeMetadata,
        repeat_indices: torch.Tensor,  # [num_draft_tokens]: each row's request
        output_token_ids: list[list[int]],  # [num_draft_tokens]: each row's past
    ) -> torch.Tensor:
        md = sampling_metadata
        if md.no_penalties:
            return logits
        assert md.prompt_token_ids is not None
        assert md.frequency_penalties is not None and md.presence_penalties is not None
        assert md.repetition_penalties is not None
        return apply_all_penalties(
            logits,
            md.prompt_token_ids[repeat_indices],
            md.presence_penalties[repeat_indices],
            md.frequency_penalties[repeat_indices],
            md.repetition_penalties[repeat_indices],
            output_token_ids,
        )

    @staticmethod
    def _combine_outputs_with_spec_tokens(
        output_token_ids: list[list[int]], spec_token_ids: list[list[int]] | None = None
    ) -> list[list[int]]:
        """One past per draft row: [out], [out, d0], [out, d0, d1], ..."""
        if spec_token_ids is None:
            return output_token_ids
        result: list[list[int]] = []
        for out, spec in zip(output_token_ids, spec_token_ids):
            result += [[*out, *spec[:pos]] for pos in range(len(spec))]
        return result


# --8<-- [start:rejection_sample]
def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_tokens], every request's drafts in a row
    num_draft_tokens: list[int],  # [batch_size]
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
    draft_probs: torch.Tensor | None,  # [num_tokens, vocab_size]
    target_logits: torch.Tensor,  # [num_tokens, vocab_size], after temperature/top-k/top-p
    bonus_token_ids: torch.Tensor,  # [batch_size, 1]
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """[batch_size, max_spec_len + 1], int32: each request's emitted tokens, then -1s."""
    assert draft_token_ids.ndim == 1 and cu_num_draft_tokens.ndim == 1
    assert draft_probs is None or draft_probs.ndim == 2
    assert target_logits.shape == (draft_token_ids.shape[0], target_logits.shape[-1])
    batch_size, device = len(num_draft_tokens), target_logits.device
    md = sampling_metadata
    if md.all_greedy:
        is_greedy = [True] * batch_size
    else:
        assert md.temperature is not None
        is_greedy = (md.temperature == GREEDY_TEMPERATURE).tolist()
    draft_ids = draft_token_ids.tolist()
    target_argmax = argmax_last_dim(target_logits).tolist()
    target_p = draft_q = uniform = recovered = None
    if not md.all_greedy:
        uniform_probs = generate_uniform_probs(
            len(draft_ids), num_draft_tokens, md.generators, device
        )
        target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
        recovered_token_ids = sample_recovered_tokens(
            max_spec_len,
            num_draft_tokens,
            cu_num_draft_tokens,
            draft_token_ids,
            draft_probs,
            target_probs,
            md,
            device,
        )
        # The acceptance rule reads only p and q at the draft token.
        index = draft_token_ids.to(torch.int64).unsqueeze(1)  # [num_tokens, 1]
        target_p = target_probs.gather(1, index).squeeze(1).tolist()
        if draft_probs is not None:
            draft_q = draft_probs.gather(1, index).squeeze(1).tolist()
        uniform = uniform_probs.tolist()
        recovered = recovered_token_ids.tolist()

    output_token_ids = torch.full(
        (batch_size, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32
    )
    bonus = bonus_token_ids.reshape(-1).tolist()
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
    return output_token_ids.to(device)


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
    logits: torch.Tensor,  # [num_tokens, vocab_size]
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p at every draft position, with its
    request's values (greedy requests: unchanged, their argmax decides)."""
    assert logits.ndim == 2 and cu_num_draft_tokens.ndim == 1
    md = sampling_metadata
    if md.all_greedy:
        return logits
    assert md.temperature is not None
    num_tokens = logits.shape[0]
    temperature = expand_batch_to_tokens(
        md.temperature,
        cu_num_draft_tokens,
        num_tokens,
        replace_from=GREEDY_TEMPERATURE,
        replace_to=1,
    )
    logits.div_(temperature.unsqueeze(-1))
    num_draft_tokens = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens[:1] * 0)
    for processor in md.logitsprocs.argmax_invariant:  # min-p
        logits = processor.apply_with_spec_decode(logits, num_draft_tokens.tolist())
    top_k = None
    if md.top_k is not None:
        top_k = expand_batch_to_tokens(md.top_k, cu_num_draft_tokens, num_tokens)
    top_p = None
    if md.top_p is not None:
        top_p = expand_batch_to_tokens(md.top_p, cu_num_draft_tokens, num_tokens)
    return apply_top_k_top_p(logits, top_k, top_p)


def expand_batch_to_tokens(
    x: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size]
    num_tokens: int,
    replace_from: float = 0,
    replace_to: float = 0,
) -> torch.Tensor:
    """[a, b, c] with cu_num_tokens [2, 5, 6] -> [a, a, b, b, b, c]; an
    element equal to ``replace_from`` becomes ``replace_to``."""
    assert cu_num_tokens.shape[0] == x.shape[0]
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens[:1] * 0).to(x.device)
    expanded = x.repeat_interleave(counts, output_size=num_tokens)  # [num_tokens]
    if replace_from != replace_to:
        expanded = expanded.masked_fill(expanded == replace_from, replace_to)
    return expanded


def generate_uniform_probs(
    num_tokens: int,
    num_draft_tokens: list[int],
    generators: dict[int, torch.Generator],
    device: torch.device | str,
) -> torch.Tensor:
    """[num_tokens], float64 (float32 can draw exactly 0): one u per draft.

    A seeded request draws its own from its generator, and a request without
    drafts draws nothing, so its stream does not depend on the batch.
    """
    uniform_probs = torch.rand((num_tokens,), dtype=torch.float64, device=device)
    start = 0
    for req, n in enumerate(num_draft_tokens):
        if n and (generator := generators.get(req)) is not None:
            uniform_probs[start : start + n].uniform_(generator=generator)
        start += n
    return uniform_probs


def sample_recovered_tokens(
    max_spec_len: int,
    num_draft_tokens: list[int],
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
    draft_token_ids: torch.Tensor,  # [num_tokens]
    draft_probs: torch.Tensor | None,  # [num_tokens, vocab_size]
    target_probs: torch.Tensor,  # [num_tokens, vocab_size]
    sampling_metadata: SamplingMetadata,
    device: torch.device | str,
) -> torch.Tensor:
    """[num_tokens], ``draft_token_ids``'s dtype: at each position, a draw
    from norm(max(p - q, 0)).

    Only the first rejected position's draw is ever used, so each request
    shares one exponential-race noise row across its positions (as vLLM).
    Without q the draft token is simply taken out of p. vLLM's kernel runs
    a (request, position < max_spec_len) grid; here one batched argmax.
    """
    batch_size, vocab_size = len(num_draft_tokens), target_probs.shape[-1]
    assert cu_num_draft_tokens.shape[0] == batch_size and max_spec_len >= max(num_draft_tokens)
    q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=device)
    q.exponential_()
    for req, generator in sampling_metadata.generators.items():
        if num_draft_tokens[req] > 0:  # draw nothing for a request without drafts
            q[req].exponential_(generator=generator)
    inv_q = q.reciprocal()
    draft_ids = draft_token_ids.reshape(-1).to(torch.int64)  # vLLM's tests pass [num_tokens, 1]
    if draft_probs is None:
        prob = target_probs.clone()
        prob[torch.arange(len(draft_ids), device=prob.device), draft_ids] = 0.0
    else:
        prob = (target_probs - draft_probs).clamp_min_(0.0)
    req_of_token = torch.arange(batch_size, device=prob.device).repeat_interleave(
        torch.tensor(num_draft_tokens, device=prob.device)
    )
    # argmax(prob / E) is a draw from prob / sum(prob): no need to normalize.
    recovered = (prob * inv_q[req_of_token]).argmax(dim=-1)  # [num_tokens]
    return recovered.to(draft_token_ids.dtype).view(draft_token_ids.shape)
