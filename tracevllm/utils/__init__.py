"""Small helpers shared across the engine (vllm/utils/)."""
