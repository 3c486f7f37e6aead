"""Sampling (vllm/v1/sample/)."""
