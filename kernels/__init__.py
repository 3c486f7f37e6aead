"""Kernels behind tracevllm/_custom_ops.py (vLLM's csrc/ and v1/attention/ops/).

Each kernel has a plain-PyTorch reference beside it (``*_torch``); a Triton
version joins it later and is tested against the reference.
"""
