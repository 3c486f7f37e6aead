"""The worker's KV connector, one per process, and the functions that reach it.

Mirrors vllm/distributed/kv_transfer/kv_transfer_state.py. The attention
layer's hooks find the worker-side connector through ``get_kv_transfer_group``
(there is no other path from a layer to it), so it is process-wide, as
vLLM's. tracevllm departs in one place: ``ensure_kv_transfer_initialized``
refuses a second connector while one is live (vLLM keeps the first, which is
another engine's), since two in-process engines (``enable_multiprocessing``
off) would otherwise load and save through each other's connector. Left out:
syncing ``engine_id`` across tensor-parallel ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracevllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from tracevllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig
    from tracevllm.kv_cache_interface import KVCacheConfig

_KV_CONNECTOR_AGENT: KVConnectorBase_V1 | None = None


def get_kv_transfer_group() -> KVConnectorBase_V1:
    assert _KV_CONNECTOR_AGENT is not None, (
        "disaggregated KV cache transfer parallel group is not initialized"
    )
    return _KV_CONNECTOR_AGENT


def has_kv_transfer_group() -> bool:
    return _KV_CONNECTOR_AGENT is not None


def is_v1_kv_transfer_group(connector: KVConnectorBase_V1 | None = None) -> bool:
    """Whether the connector (default: this process's) is a V1 one (tracevllm has no other)."""
    connector = connector if connector is not None else _KV_CONNECTOR_AGENT
    return isinstance(connector, KVConnectorBase_V1)


def ensure_kv_transfer_initialized(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Create this process's worker-side connector, if the config asks for one."""
    global _KV_CONNECTOR_AGENT
    kv_transfer_config = vllm_config.kv_transfer_config
    if kv_transfer_config is None or not kv_transfer_config.is_kv_transfer_instance:
        return
    if _KV_CONNECTOR_AGENT is not None:
        raise RuntimeError(
            "A KV connector is already running in this process (another in-process "
            "engine's): shut that engine down first, or run the engines in their own "
            "processes (enable_multiprocessing)."
        )
    _KV_CONNECTOR_AGENT = KVConnectorFactory.create_connector(
        config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
    )


def ensure_kv_transfer_shutdown(vllm_config: VllmConfig | None = None) -> None:
    """Shut this process's worker-side connector down. With ``vllm_config``
    (tracevllm's), only if that engine's config created it: an in-process
    engine without a connector, or one refused because another's runs, must
    not shut down the live engine's connector as it shuts down itself."""
    global _KV_CONNECTOR_AGENT
    if vllm_config is not None and (
        _KV_CONNECTOR_AGENT is None or _KV_CONNECTOR_AGENT._vllm_config is not vllm_config
    ):
        return
    if _KV_CONNECTOR_AGENT is not None:
        _KV_CONNECTOR_AGENT.shutdown()
        _KV_CONNECTOR_AGENT = None
