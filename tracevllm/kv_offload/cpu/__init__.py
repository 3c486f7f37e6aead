"""The CPU tier: a host-memory region with its own LRU (vllm/v1/kv_offload/cpu/)."""
