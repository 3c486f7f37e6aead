"""Lab 13: the MoE router. Your version of
``tracevllm.model_executor.layers.fused_moe.router.fused_topk_router.fused_topk``.

Read README.md first. Test it with ``make lab CH=13``; plug it into the
engine with ``TRACEVLLM_LAB=13`` and serve a mixture-of-experts model
(Qwen3-MoE): every MoE layer of every step then routes with your code.
"""

from __future__ import annotations

import torch


def fused_topk(
    hidden_states: torch.Tensor,  # [num_tokens, hidden_size]: only its token count is read
    gating_output: torch.Tensor,  # [num_tokens, num_experts]: the router's logits
    topk: int,
    renormalize: bool,
    indices_type: torch.dtype | None = None,
    scoring_func: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's ``topk`` best experts and their weights.

    Returns ``(topk_weights [num_tokens, topk] float32, topk_ids [num_tokens,
    topk] int32 or indices_type, token_expert_indices [num_tokens, topk] int32)``.
    """
    # TODO 1: refuse what cannot be routed, with a ValueError: hidden_states
    #         and gating_output with different token counts; a topk that is
    #         not an int in [1, num_experts] (a bool is not an int); a
    #         scoring_func other than "softmax" or "sigmoid" (the message:
    #         "Unsupported scoring function: <name>").
    # TODO 2: score every expert, in float32 whatever the logits' dtype:
    #         softmax over the experts, or sigmoid of each logit.
    # TODO 3: keep each token's topk highest scores and their expert ids,
    #         best first.
    # TODO 4: renormalize: divide the kept scores by their sum, per token.
    # TODO 5: ids as indices_type (int32 when None); token_expert_indices[t, k]
    #         = k * num_tokens + t, int32.
    raise NotImplementedError("Lab 13: fused_topk (see chapters/13-moe-router)")
