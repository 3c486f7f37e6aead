"""Benchmarks with vLLM's names (vllm/benchmarks/)."""
