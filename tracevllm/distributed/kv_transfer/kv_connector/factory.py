"""``KVConnectorFactory``: connector classes by name, loaded on first use.

Mirrors vllm/distributed/kv_transfer/kv_connector/factory.py. A connector is
registered as (name, module path, class name), so that naming one imports
nothing: the frontend checks the name (``check_connector_name``) without
loading torch, and each role imports the module when it creates its
connector. ``kv_connector_module_path`` loads a class from outside the
registry, as vLLM's. Left out: the hybrid-allocator check (tracevllm refuses
a connector on a model with several KV cache groups: ``create_connector``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from tracevllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from tracevllm.logger import init_logger

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig
    from tracevllm.distributed.kv_transfer.kv_transfer_config import KVTransferConfig
    from tracevllm.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)


class KVConnectorFactory:
    _registry: dict[str, Callable[[], type[KVConnectorBase_V1]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register a connector by module and class name (imported when created)."""
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")

        def loader() -> type[KVConnectorBase_V1]:
            module = importlib.import_module(module_path)
            connector_cls: type[KVConnectorBase_V1] = getattr(module, class_name)
            return connector_cls

        cls._registry[name] = loader

    @classmethod
    def create_connector(
        cls, config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> KVConnectorBase_V1:
        kv_transfer_config = config.kv_transfer_config
        if kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set to create a connector")
        connector_cls = cls.get_connector_class(kv_transfer_config)
        # vLLM: a connector without SupportsHMA needs the hybrid allocator off,
        # i.e. one KV cache group; tracevllm has no switch, so it refuses.
        if len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(
                f"Connector {connector_cls.__name__} needs a model with one KV cache group "
                f"(every layer full attention, or every layer the same window); this one "
                f"has {len(kv_cache_config.kv_cache_groups)}."
            )
        logger.info(
            "Creating v1 connector with name: %s and engine_id: %s",
            connector_cls.__name__,
            kv_transfer_config.engine_id,
        )
        # Two roles, built apart: the scheduler's never touches KV tensors,
        # the worker's never sees the scheduler's state.
        return connector_cls(config, role, kv_cache_config)

    @classmethod
    def get_connector_class(cls, kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        connector_name = kv_transfer_config.kv_connector
        if connector_name is None:
            raise ValueError("Connector name is not set in KVTransferConfig")
        module_path = kv_transfer_config.kv_connector_module_path
        if module_path is not None and not module_path:
            raise ValueError("kv_connector_module_path cannot be an empty string.")
        if module_path:
            # An outside module takes priority over the registry.
            module = importlib.import_module(module_path)
            try:
                connector_cls: type[KVConnectorBase_V1] = getattr(module, connector_name)
            except AttributeError as e:
                raise AttributeError(f"Class {connector_name} not found in {module_path}") from e
            return connector_cls
        if connector_name in cls._registry:
            return cls._registry[connector_name]()
        raise ValueError(f"Unsupported connector type: {connector_name}")

    @classmethod
    def check_connector_name(cls, kv_transfer_config: KVTransferConfig) -> None:
        """vLLM's 'Unsupported connector type' error, raised without importing
        the connector (tracevllm's: the frontend checks before it starts an engine)."""
        name = kv_transfer_config.kv_connector
        module_path = kv_transfer_config.kv_connector_module_path
        if name is not None and not module_path and name not in cls._registry:
            raise ValueError(
                f"Unsupported connector type: {name} (tracevllm has {sorted(cls._registry)})"
            )


# --8<-- [start:register_connector]
KVConnectorFactory.register_connector(
    "ExampleConnector",
    "tracevllm.distributed.kv_transfer.kv_connector.v1.example_connector",
    "ExampleConnector",
)
KVConnectorFactory.register_connector(
    "NixlConnector",
    "tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
    "NixlConnector",
)
# --8<-- [end:register_connector]
KVConnectorFactory.register_connector(
    "OffloadingConnector",
    "tracevllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "OffloadingConnector",
)
