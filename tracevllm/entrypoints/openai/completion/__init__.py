"""POST /v1/completions (vllm/entrypoints/openai/completion/)."""
