"""POST /v1/chat/completions (vllm/entrypoints/openai/chat_completion/)."""
