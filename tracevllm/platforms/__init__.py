"""What the engine sets up for the hardware it runs on (vllm/platforms/)."""
