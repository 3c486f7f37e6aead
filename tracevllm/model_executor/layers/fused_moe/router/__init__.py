"""Routers of the FusedMoE layer (vllm/model_executor/layers/fused_moe/router/)."""
