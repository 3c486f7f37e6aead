"""Tool calls served through structured outputs (vLLM's vllm/tool_parsers/, without parsers)."""
