"""vLLM's own endpoints beside the OpenAI ones (vllm/entrypoints/serve/)."""
