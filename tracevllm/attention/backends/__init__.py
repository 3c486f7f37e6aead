"""Attention backends: cpu_attn (CPU default), torch (reference) and triton (CUDA default)."""
