"""From a config.json's ``architectures`` to the class that runs it.

Mirrors vllm/model_executor/models/registry.py (``_TEXT_GENERATION_MODELS``,
``_ModelRegistry`` with ``register_model``, ``get_supported_archs``,
``resolve_model_cls``, ``_LazyRegisteredModel``, ``_RegisteredModel``, and the
module-level ``ModelRegistry``). Each architecture names a module of this
package and a class in it, imported the first time a model asks for it, so
reading the registry (the frontend does, to refuse an unknown model before
any weight is loaded) imports neither torch nor any model file.

``ModelRegistry.register_model("MyForCausalLM", MyForCausalLM)`` (or
``"my_pkg.my_model:MyForCausalLM"``) adds an out-of-tree model. The engine
process sees it because ``ModelConfig`` carries the registration along
(tracevllm's own: vLLM asks for a plugin, loaded in every process); so a
class must be importable by its module path, not defined inside a function.

Left out: model inspection in a subprocess (``_ModelInfo``), the Transformers
backend fallback, pooling/multimodal/speculative tables, architecture
normalisation across runner types.
"""

from __future__ import annotations

import importlib
from collections.abc import Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracevllm.logger import init_logger

if TYPE_CHECKING:
    from torch import nn

    from tracevllm.config import ModelConfig

logger = init_logger(__name__)

# --8<-- [start:text_generation_models]
_TEXT_GENERATION_MODELS: dict[str, tuple[str, str]] = {
    # [Decoder-only]  architecture: (module in this package, class)
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    # Mistral is Llama with a sliding window; vLLM's mistral.py subclasses
    # llama.py for Mistral's own checkpoint format, which tracevllm does not read.
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}
# --8<-- [end:text_generation_models]

_VLLM_MODELS = {**_TEXT_GENERATION_MODELS}


@dataclass(frozen=True)
class _RegisteredModel:
    """A class handed over already imported."""

    model_cls: type[nn.Module]

    def load_model_cls(self) -> type[nn.Module]:
        return self.model_cls


@dataclass(frozen=True)
class _LazyRegisteredModel:
    """A class named by module and class name, imported on first use."""

    module_name: str
    class_name: str

    def load_model_cls(self) -> type[nn.Module]:
        module = importlib.import_module(self.module_name)
        return getattr(module, self.class_name)  # type: ignore[no-any-return]


_BaseRegisteredModel = _RegisteredModel | _LazyRegisteredModel


@dataclass
class _ModelRegistry:
    # Keyed by architecture name.
    models: dict[str, _BaseRegisteredModel] = field(default_factory=dict)

    def get_supported_archs(self) -> Set[str]:
        return self.models.keys()

    def register_model(self, model_arch: str, model_cls: type[nn.Module] | str) -> None:
        """Add (or replace) an architecture: a ``torch.nn.Module`` class, or
        ``"<module>:<class>"`` to import it lazily."""
        if not isinstance(model_arch, str):
            raise TypeError(f"`model_arch` should be a string, not a {type(model_arch)}")
        if model_arch in self.models:
            logger.warning(
                "Model architecture %s is already registered, and will be "
                "overwritten by the new model class %s.",
                model_arch,
                model_cls,
            )
        model: _BaseRegisteredModel
        if isinstance(model_cls, str):
            split_str = model_cls.split(":")
            if len(split_str) != 2:
                raise ValueError("Expected a string in the format `<module>:<class>`")
            model = _LazyRegisteredModel(*split_str)
        elif isinstance(model_cls, type) and _is_module_class(model_cls):
            model = _RegisteredModel(model_cls)
        else:
            raise TypeError(
                f"`model_cls` should be a string or PyTorch model class, not a {type(model_cls)}"
            )
        self.models[model_arch] = model

    def _raise_for_unsupported(self, architectures: list[str]) -> Any:
        raise ValueError(
            f"Model architectures {architectures} are not supported for now. "
            f"Supported architectures: {sorted(self.get_supported_archs())}"
        )

    def resolve_arch(self, architectures: str | list[str]) -> str:
        """The first of ``architectures`` that is registered (tracevllm's: the
        check the frontend makes without importing a model)."""
        if isinstance(architectures, str):
            architectures = [architectures]
        if not architectures:
            raise ValueError("No model architectures are specified")
        for arch in architectures:
            if arch in self.models:
                return arch
        return self._raise_for_unsupported(architectures)  # type: ignore[no-any-return]

    def resolve_model_cls(
        self, architectures: str | list[str], model_config: ModelConfig | None = None
    ) -> tuple[type[nn.Module], str]:
        """(the class, the architecture it was found under)."""
        arch = self.resolve_arch(architectures)
        return self.models[arch].load_model_cls(), arch

    def out_of_tree_models(self) -> dict[str, _BaseRegisteredModel]:
        """Registrations beyond the built-in table (what ModelConfig carries
        to the engine process)."""
        return {
            arch: model
            for arch, model in self.models.items()
            if _VLLM_MODELS.get(arch) is None or model != _in_tree(arch)
        }


def _in_tree(arch: str) -> _LazyRegisteredModel:
    module, cls = _VLLM_MODELS[arch]
    return _LazyRegisteredModel(f"tracevllm.model_executor.models.{module}", cls)


def _is_module_class(cls: type) -> bool:
    # A class handed over is already imported, and so is torch.
    from torch import nn

    return issubclass(cls, nn.Module)


ModelRegistry = _ModelRegistry({arch: _in_tree(arch) for arch in _VLLM_MODELS})
