"""What every OpenAI endpoint shares: error objects, usage, the serving base.

vllm/entrypoints/openai/engine/.
"""
