"""KV connectors (vllm/distributed/kv_transfer/kv_connector/): factory.py and v1/."""
