"""The model runner and its persistent batch (vllm/v1/worker/)."""
