"""Kernels behind tracevllm/_custom_ops.py (vLLM's csrc/ and v1/attention/ops/).

Each file holds a plain-PyTorch reference (``*_torch``) and a Triton kernel
with its launcher (``*_triton``), tested against it (tests/test_kernels.py,
on CPU in Triton's interpreter). flash_attention.py walks from naive attention
to a Triton FlashAttention forward, for the book. triton_utils.py makes Triton
optional: without it the references still import and run.
"""
