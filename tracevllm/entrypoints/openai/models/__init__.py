"""GET /v1/models (vllm/entrypoints/openai/models/)."""
