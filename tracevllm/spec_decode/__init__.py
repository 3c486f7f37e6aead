"""Speculative decoding: proposers of draft tokens, their metadata and stats.

Mirrors vllm/v1/spec_decode/. The drafts are verified by
tracevllm/sample/rejection_sampler.py; the scheduler and the model runner
carry them from one step to the next.
"""
