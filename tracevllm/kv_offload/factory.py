"""``OffloadingSpecFactory``: offload tiers by name, imported on first use.

Mirrors vllm/v1/kv_offload/factory.py. ``kv_connector_extra_config``'s
``spec_name`` picks the tier (default ``CPUOffloadingSpec``), or
``spec_module_path`` loads one from outside the registry. Left out: vLLM's
``TieringOffloadingSpec`` (a chain of tiers).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from tracevllm.kv_offload.base import OffloadingSpec
from tracevllm.logger import init_logger

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig
    from tracevllm.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)


class OffloadingSpecFactory:
    _registry: dict[str, Callable[[], type[OffloadingSpec]]] = {}

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")

        def loader() -> type[OffloadingSpec]:
            module = importlib.import_module(module_path)
            spec_cls: type[OffloadingSpec] = getattr(module, class_name)
            return spec_cls

        cls._registry[name] = loader

    @classmethod
    def create_spec(cls, config: VllmConfig, kv_cache_config: KVCacheConfig) -> OffloadingSpec:
        kv_transfer_config = config.kv_transfer_config
        assert kv_transfer_config is not None
        extra_config = kv_transfer_config.kv_connector_extra_config
        spec_name = extra_config.get("spec_name", "CPUOffloadingSpec")
        if spec_name in cls._registry:
            spec_cls = cls._registry[spec_name]()
        else:
            spec_module_path = extra_config.get("spec_module_path")
            if spec_module_path is None:
                raise ValueError(f"Unsupported spec type: {spec_name}")
            spec_cls = getattr(importlib.import_module(spec_module_path), spec_name)
        assert issubclass(spec_cls, OffloadingSpec)
        logger.info("Creating offloading spec with name: %s", spec_name)
        return spec_cls(config, kv_cache_config)


OffloadingSpecFactory.register_spec(
    "CPUOffloadingSpec", "tracevllm.kv_offload.cpu.spec", "CPUOffloadingSpec"
)
