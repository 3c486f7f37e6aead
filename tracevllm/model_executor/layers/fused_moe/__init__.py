"""The mixture-of-experts layer (vllm/model_executor/layers/fused_moe/).

``FusedMoE`` (layer.py) holds every expert's weights, stacked, and loads
them by expert id. ``fused_topk`` (router/fused_topk_router.py) picks each
token's experts, ``moe_align_block_size`` groups the (token, expert) rows
by expert, and ``fused_experts`` (fused_moe.py) runs the two grouped GEMMs:
the Triton ``fused_moe_kernel`` or its plain-PyTorch reference
(kernels/fused_moe.py).
"""

from tracevllm.model_executor.layers.fused_moe.fused_moe import fused_experts
from tracevllm.model_executor.layers.fused_moe.layer import FusedMoE
from tracevllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
from tracevllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

__all__ = ["FusedMoE", "fused_experts", "fused_topk", "moe_align_block_size"]
