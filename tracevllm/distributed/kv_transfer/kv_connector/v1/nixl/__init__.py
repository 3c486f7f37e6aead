"""vLLM's NixlConnector package (vllm/distributed/kv_transfer/kv_connector/v1/nixl/)."""

from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

__all__ = ["NixlConnector"]
