"""Sampling ops (vllm/v1/sample/ops/)."""
