"""Model definitions (vllm/model_executor/models/)."""
