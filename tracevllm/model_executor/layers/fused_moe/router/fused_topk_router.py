"""The router: each token's top-k experts and the weights its outputs are summed with.

Mirrors vllm/model_executor/layers/fused_moe/router/fused_topk_router.py
(``fused_topk``) and the CUDA ``topk_softmax`` / ``topk_sigmoid`` it calls
(csrc/moe/topk_softmax_kernels.cu), written in torch. Left out: the
``FusedTopKRouter`` class and its base (expert-parallel load balancing, the
indices dtype getter), grouped top-k (DeepSeek) and custom routing functions.
"""

from __future__ import annotations

import torch

from tracevllm.labs import lab_hook


# --8<-- [start:fused_topk]
@lab_hook("fused_topk")  # lab 13: chapters/13-moe-router
def fused_topk(
    hidden_states: torch.Tensor,  # [num_tokens, hidden_size]: only its token count is read
    gating_output: torch.Tensor,  # [num_tokens, num_experts]: the router's logits
    topk: int,
    renormalize: bool,
    indices_type: torch.dtype | None = None,
    scoring_func: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score every expert, keep each token's ``topk`` best, optionally renormalise.

    Softmax scoring (Mixtral, Qwen3-MoE): ``p = softmax(logits)`` over all
    experts in fp32, the ``topk`` largest kept; with ``renormalize``
    (Qwen3-MoE's ``norm_topk_prob``, always on in Mixtral) the kept weights
    are divided by their sum, so they add up to 1. Without it they are the
    plain probabilities, summing to less than 1. Sigmoid scoring scores each
    expert on its own (``sigmoid(logits)``).

    Returns ``(topk_weights [num_tokens, topk] fp32, topk_ids [num_tokens,
    topk] int32 or indices_type, token_expert_indices [num_tokens, topk]
    int32)``; as the CUDA kernel, ``token_expert_indices[t, k] = k *
    num_tokens + t`` (a (token, k) pair's row in a k-major layout).
    """
    num_tokens, num_experts = gating_output.shape
    if hidden_states.size(0) != num_tokens:
        raise ValueError(
            f"Number of tokens mismatch: hidden_states has {hidden_states.size(0)}, "
            f"gating_output {num_tokens}."
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be an int in [1, {num_experts}] (the experts), got {topk!r}.")
    if scoring_func == "softmax":
        scores = torch.softmax(gating_output.float(), dim=-1)  # [num_tokens, num_experts]
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(gating_output.float())
    else:
        raise ValueError(f"Unsupported scoring function: {scoring_func}")
    topk_weights, topk_ids = torch.topk(scores, topk, dim=-1)  # [num_tokens, topk] each
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    token_expert_indices = (
        torch.arange(topk, dtype=torch.int32, device=gating_output.device)[None, :] * num_tokens
        + torch.arange(num_tokens, dtype=torch.int32, device=gating_output.device)[:, None]
    )  # [num_tokens, topk]
    return topk_weights, topk_ids.to(indices_type or torch.int32), token_expert_indices


# --8<-- [end:fused_topk]
