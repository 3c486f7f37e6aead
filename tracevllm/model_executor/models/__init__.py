"""Model definitions (vllm/model_executor/models/): one file per family, found
through ``ModelRegistry`` by config.json's ``architectures``."""

from tracevllm.model_executor.models.registry import ModelRegistry

__all__ = ["ModelRegistry"]
