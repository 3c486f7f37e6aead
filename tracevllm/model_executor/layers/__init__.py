"""Model layers (vllm/model_executor/layers/)."""
