"""POST /tokenize and /detokenize (vllm/entrypoints/serve/tokenize/)."""
