"""Top-k / top-p filtering and the sampling draw.

Mirrors vllm/v1/sample/ops/topk_topp_sampler.py (``apply_top_k_top_p``,
``apply_top_k_top_p_pytorch``, ``apply_top_k_only``, ``random_sample``).
``apply_top_k_top_p`` dispatches as vLLM's does, minus the Triton kernel
vLLM takes on a GPU for batches of 8 or more: every batch goes to the
PyTorch path, which may sync with the CPU (``allow_cpu_sync``, top-k without a
sort) on a CPU only. Left out: the ``TopKTopPSampler`` module with its
FlashInfer, ROCm and XPU paths, and returning processed logprobs.
"""

from __future__ import annotations

import torch

from tracevllm.labs import lab_hook
from tracevllm.sample.ops.argmax import argmax_last_dim


# --8<-- [start:apply_top_k_top_p]
@lab_hook("apply_top_k_top_p")  # lab 05: chapters/05-top-k-top-p
def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_reqs, vocab_size]
    k: torch.Tensor | None,  # [num_reqs]; vocab_size = no top-k
    p: torch.Tensor | None,  # [num_reqs]; 1.0 = no top-p
) -> torch.Tensor:
    """Set logits outside the top-k / top-p nucleus to -inf (in place)."""
    if p is None and k is None:
        return logits
    # A GPU->CPU sync stalls the GPU; on a CPU it costs nothing.
    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=logits.device.type == "cpu")


def apply_top_k_top_p_pytorch(
    logits: torch.Tensor,  # [num_reqs, vocab_size]
    k: torch.Tensor | None,  # [num_reqs]
    p: torch.Tensor | None,  # [num_reqs]
    allow_cpu_sync: bool = False,
) -> torch.Tensor:
    """Sort ascending once; top-k masks everything below the k-th largest
    value (ties with it survive), top-p masks the low tail whose probability
    mass is at most 1 - p. The largest logit always survives."""
    if p is None:
        if k is None:
            return logits
        if allow_cpu_sync:
            return apply_top_k_only(logits, k)  # no sort of the whole vocabulary
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # [num_reqs, vocab_size]
    if k is not None:
        kth = logits_sort.size(1) - k.to(torch.long)  # [num_reqs]: column of the k-th largest
        kth_value = logits_sort.gather(1, kth.unsqueeze(1))  # [num_reqs, 1]
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    if p is not None:
        probs_sort = logits_sort.softmax(dim=-1)  # [num_reqs, vocab_size]
        probs_sum = torch.cumsum(probs_sort, dim=-1)  # [num_reqs, vocab_size]
        top_p_mask = probs_sum <= 1 - p.unsqueeze(1)  # [num_reqs, vocab_size]
        top_p_mask[:, -1] = False  # keep at least one
        logits_sort.masked_fill_(top_p_mask, float("-inf"))
    # Undo the sort.
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


# --8<-- [end:apply_top_k_top_p]


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Top-k without sorting the whole vocabulary: ``topk`` to the largest k in the batch."""
    no_top_k = k == logits.shape[1]  # [num_reqs]
    k = k.masked_fill(no_top_k, 1).to(torch.long)
    max_top_k = int(k.max())
    topk_values = logits.topk(max_top_k, dim=1).values  # [num_reqs, max_top_k]
    kth_value = topk_values.gather(1, (k - 1).unsqueeze(1))  # [num_reqs, 1]
    kth_value.masked_fill_(no_top_k.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth_value, float("-inf"))


# --8<-- [start:random_sample]
def random_sample(
    probs: torch.Tensor,  # [num_reqs, vocab_size]
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """Draw one token per row: ``argmax(probs / q)`` with ``q ~ Exponential(1)``.

    The exponential-race trick samples exactly from ``probs`` (the smallest
    arrival time E_i / p_i wins with probability p_i) without
    ``torch.multinomial``, which would sync the GPU. Rows with a seed draw
    their noise from their own generator, so a seeded request gets the same
    tokens whatever else is in the batch.
    """
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for i, generator in generators.items():
        q[i].exponential_(generator=generator)
    return argmax_last_dim(probs.div_(q)).view(-1)  # [num_reqs]: argmax, in two passes


# --8<-- [end:random_sample]
