"""Attention backends behind one interface (vllm/v1/attention/)."""
