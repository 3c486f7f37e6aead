"""The experts of a MoE layer for a routed batch: two grouped GEMMs around the activation.

Mirrors vllm/model_executor/layers/fused_moe/fused_moe.py (``fused_experts``,
``fused_experts_impl``). The kernel and its tile choice live in
kernels/fused_moe.py, reached through tracevllm/_custom_ops.py; the routing
in router/fused_topk_router.py. With ``backend="torch"`` the same steps run
the plain-PyTorch reference of the kernel: that is the reference path of
the whole layer. Left out: quantization (scales, zero points, fp8/int8/int4
inputs), expert parallelism (``expert_map``), biases, activations other than
SiLU, the router's weight on the input (``apply_router_weight_on_input``,
Llama-4), in-place output, the tuned config files, and the custom-op
registration (torch.compile).
"""

from __future__ import annotations

import torch

from tracevllm import _custom_ops as ops
from tracevllm.model_executor.layers.activation import SiluAndMul
from tracevllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size


def default_moe_backend(device: torch.device) -> str:
    """``"triton"`` on a GPU, else ``"torch"``, as the attention backend's default."""
    return "triton" if device.type == "cuda" else "torch"


# --8<-- [start:fused_experts]
def fused_experts(
    hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
    w1: torch.Tensor,  # [num_experts, 2 * intermediate, hidden_size]: gate, then up
    w2: torch.Tensor,  # [num_experts, hidden_size, intermediate]: down
    topk_weights: torch.Tensor,  # [num_tokens, top_k], float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k], int32
    activation: str = "silu",
    global_num_experts: int = -1,
    backend: str | None = None,
) -> torch.Tensor:
    """``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, k]``.

    The steps of vLLM's ``fused_experts_impl``: pick tile sizes for this
    many tokens; group the (token, k) rows by expert in blocks of
    ``BLOCK_SIZE_M`` (``moe_align_block_size``); the first grouped GEMM
    (``x @ w1[e].T``, a row per (token, k)); SiLU-and-mul; the second
    (``@ w2[e].T``, scaled by the router's weight); the sum over k. ``backend``
    is "torch" or "triton" (None: by device).
    """
    if activation != "silu":
        raise ValueError(f"Unsupported FusedMoe activation: {activation}.")
    assert hidden_states.size(1) == w1.size(2), (
        f"Hidden size mismatch {hidden_states.size(1)} != {w1.size(2)}"
    )
    assert topk_weights.size() == topk_ids.size(), "topk shape mismatch"
    assert hidden_states.is_contiguous(), "Hidden_states must be contiguous"
    assert w1.stride(-1) == 1 and w2.stride(-1) == 1, "Stride of last dimension must be 1"
    if backend is None:
        backend = default_moe_backend(hidden_states.device)

    M = hidden_states.size(0)
    E, N, _ = w1.size()  # N = 2 * intermediate (one TP shard's)
    K = w2.size(1)  # hidden_size
    top_k = topk_ids.size(1)
    if global_num_experts == -1:
        global_num_experts = E
    config = ops.get_default_config(M, E, N, w1.size(2), top_k, hidden_states.dtype)

    sorted_token_ids, expert_ids, num_tokens_post_padded = moe_align_block_size(
        topk_ids, config["BLOCK_SIZE_M"], global_num_experts
    )
    routing = (topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded)

    # [num_tokens, top_k, 2 * intermediate]: every (token, k) row through its expert's gate/up.
    intermediate_cache1 = hidden_states.new_empty(M, top_k, N)
    ops.dispatch_fused_moe_kernel(
        hidden_states,
        w1,
        intermediate_cache1,
        *routing,
        False,  # the router's weight is applied once, after the down projection
        top_k,
        config,
        backend,
    )
    # [num_tokens * top_k, intermediate]
    # PyTorch's ops (a layer's C++ kernel is chosen where a layer is built, under its config).
    intermediate_cache2 = SiluAndMul.forward_native(intermediate_cache1.view(-1, N))
    # [num_tokens, top_k, hidden_size]: each row already is one (token, k), so top_k = 1 here.
    intermediate_cache3 = hidden_states.new_empty(M, top_k, K)
    ops.dispatch_fused_moe_kernel(
        intermediate_cache2,
        w2,
        intermediate_cache3,
        *routing,
        True,
        1,
        config,
        backend,
    )
    out_hidden_states = torch.empty_like(hidden_states)  # [num_tokens, hidden_size]
    ops.moe_sum(intermediate_cache3, out_hidden_states)
    return out_hidden_states


# --8<-- [end:fused_experts]
