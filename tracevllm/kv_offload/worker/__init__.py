"""The offload tier's worker side (vllm/v1/kv_offload/worker/)."""
