"""``KVTransferConfig``: which KV connector an engine runs, and in which role.

Mirrors vllm/config/kv_transfer.py. It lives here rather than in
tracevllm/config.py (vLLM's vllm/config/ folded into one module) because that
module is shared by every feature and already over its size; config.py
re-exports it, so ``from tracevllm.config import KVTransferConfig`` reads as
vLLM's ``from vllm.config import KVTransferConfig``. Torch-free: the frontend
builds it before the engine process starts.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

# vLLM's KVRole literals.
KV_PRODUCER_ROLES = ("kv_producer", "kv_both")
KV_CONSUMER_ROLES = ("kv_consumer", "kv_both")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


# --8<-- [start:kv_transfer_config]
@dataclass(slots=True)
class KVTransferConfig:
    """KV cache transfer between engines (disaggregated prefill) or to a second tier.

    ``kv_connector`` names a connector in ``KVConnectorFactory``'s registry
    (or a class in ``kv_connector_module_path``); ``kv_role`` says whether
    this engine saves KV (``kv_producer``), loads it (``kv_consumer``) or
    both. ``kv_load_failure_policy``: a load that fails is recomputed
    (``recompute``) or fails its request (``fail``, vLLM's default).
    ``kv_connector_extra_config`` is the connector's own (the
    ExampleConnector's ``shared_storage_path``). vLLM's errors for the role;
    tracevllm also checks each field's type (vLLM's pydantic layer does) and
    refuses unknown keys (``from_dict``). ``kv_buffer_device`` defaults to
    ``cpu``, the device tracevllm runs on (vLLM: the platform's).
    """

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cpu"
    kv_buffer_size: float = 1e9
    kv_role: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        self._check_types()
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"Unsupported kv_role: {self.kv_role}. Supported roles are {KV_ROLES}")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError(
                f"Please specify kv_role when kv_connector is set, supported roles are {KV_ROLES}"
            )
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                "kv_load_failure_policy must be 'recompute' or 'fail', "
                f"got {self.kv_load_failure_policy!r}."
            )

    def _check_types(self) -> None:
        for name in ("kv_connector", "engine_id", "kv_role", "kv_connector_module_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string, got {type(value).__name__}.")
        for name in ("kv_buffer_device", "kv_ip", "kv_load_failure_policy"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a string, got {type(value).__name__}.")
        for name in ("kv_rank", "kv_parallel_size", "kv_port"):
            value = getattr(self, name)
            if value is None and name == "kv_rank":
                continue
            # A bool is not an int.
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
        size = self.kv_buffer_size
        if isinstance(size, bool) or not isinstance(size, int | float) or not math.isfinite(size):
            raise TypeError(f"kv_buffer_size must be a finite number, got {size!r}.")
        if not isinstance(self.enable_permute_local_kv, bool):
            raise TypeError(
                "enable_permute_local_kv must be a bool, "
                f"got {type(self.enable_permute_local_kv).__name__}."
            )
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise TypeError("kv_connector_extra_config must be a dict with string keys.")

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_ROLES

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_PRODUCER_ROLES

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_CONSUMER_ROLES

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> KVTransferConfig:
        """What ``kv_transfer_config={...}`` or ``--kv-transfer-config '{...}'`` gives."""
        if not isinstance(config, dict):
            raise TypeError(
                f"kv_transfer_config must be a dict (or JSON object), got {type(config).__name__}."
            )
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(config) - known):
            raise ValueError(
                f"kv_transfer_config has unknown keys {unknown}; the keys are {sorted(known)}."
            )
        return cls(**config)


# --8<-- [end:kv_transfer_config]
