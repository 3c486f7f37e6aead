"""The model(s) the server serves, under the names clients use.

Mirrors vllm/entrypoints/openai/models/serving.py (``OpenAIServingModels``:
``show_available_models``, ``is_base_model``, ``model_name``) and
``BaseModelPath`` from vllm/entrypoints/openai/models/protocol.py. One base
model, no LoRA adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracevllm.entrypoints.openai.engine.protocol import ModelCard, ModelList


@dataclass(slots=True)
class BaseModelPath:
    name: str
    model_path: str


class OpenAIServingModels:
    def __init__(self, base_model_paths: list[BaseModelPath], max_model_len: int) -> None:
        self.base_model_paths = base_model_paths
        self.max_model_len = max_model_len

    def is_base_model(self, model_name: str) -> bool:
        return any(model.name == model_name for model in self.base_model_paths)

    def model_name(self) -> str:
        """The name responses carry (the first served name)."""
        return self.base_model_paths[0].name

    async def show_available_models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=m.name, root=m.model_path, max_model_len=self.max_model_len)
                for m in self.base_model_paths
            ]
        )
