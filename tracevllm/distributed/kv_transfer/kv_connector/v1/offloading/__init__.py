"""The ``OffloadingConnector``'s two roles.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/offloading/.
"""
