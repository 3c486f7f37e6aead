"""What every model file uses: layer lists cut by pipeline stage, prefixes, weight loading.

Mirrors vllm/model_executor/models/utils.py (``AutoWeightsLoader``,
``PPMissingLayer``, ``make_layers``, ``get_pp_missing_layer_names``,
``is_pp_missing_parameter``, ``make_empty_intermediate_tensors_factory``,
``maybe_prefix``, ``extract_layer_index``). Left out: ``WeightsMapper``,
offloading, the multimodal and LoRA helpers, ``AutoWeightsLoader``'s
ignore lists.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tracevllm.distributed.parallel_state import get_pp_group
from tracevllm.distributed.utils import get_pp_indices
from tracevllm.model_executor.model_loader import default_weight_loader
from tracevllm.sequence import IntermediateTensors

WeightsIter = Iterable[tuple[str, torch.Tensor]]


class PPMissingLayer(nn.Identity):
    """Stands where a layer of another pipeline stage would be: no weights,
    and a forward that hands its first argument back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


# --8<-- [start:make_layers]
def make_layers(
    num_hidden_layers: int, layer_fn: Callable[..., nn.Module], prefix: str
) -> tuple[int, int, nn.ModuleList]:
    """This stage's decoder layers, built; the others ``PPMissingLayer``.

    Returns (start_layer, end_layer, layers): the list keeps every index,
    so layer i is ``layers[i]`` and its weights keep their checkpoint names
    (``model.layers.17.mlp...``) on whichever stage holds it.
    """
    pp_group = get_pp_group()
    start_layer, end_layer = get_pp_indices(
        num_hidden_layers, pp_group.rank_in_group, pp_group.world_size
    )
    modules = nn.ModuleList(
        [PPMissingLayer() for _ in range(start_layer)]
        + [layer_fn(prefix=f"{prefix}.{idx}") for idx in range(start_layer, end_layer)]
        + [PPMissingLayer() for _ in range(end_layer, num_hidden_layers)]
    )
    return start_layer, end_layer, modules


# --8<-- [end:make_layers]


def get_pp_missing_layer_names(model: nn.Module) -> list[str]:
    """The names of the layers this stage leaves out, each with a trailing
    dot (so ``layers.1.`` does not match ``layers.11``)."""
    return [
        name + "." for name, module in model.named_modules() if isinstance(module, PPMissingLayer)
    ]


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """Whether checkpoint weight ``name`` belongs to another pipeline stage."""
    if isinstance(model, PPMissingLayer):
        return True
    return any(name.startswith(missing) for missing in get_pp_missing_layer_names(model))


def make_empty_intermediate_tensors_factory(
    keys: list[str], hidden_size: int
) -> Callable[[int, torch.dtype, torch.device], IntermediateTensors]:
    """A function making zeroed ``IntermediateTensors`` of a batch size (what a
    later stage receives into)."""

    def make_empty_intermediate_tensors(
        batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        return IntermediateTensors(
            {key: torch.zeros((batch_size, hidden_size), dtype=dtype, device=device)
             for key in keys}
        )  # fmt: skip

    return make_empty_intermediate_tensors


def maybe_prefix(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` when there is no prefix."""
    return name if not prefix else f"{prefix}.{name}"


def extract_layer_index(layer_name: str) -> int:
    """The one integer in a module name: ``model.layers.7.self_attn`` -> 7."""
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    assert len(numbers) == 1, f"layer name {layer_name} should only contain one integer"
    return numbers[0]


class AutoWeightsLoader:
    """Load checkpoint weights into ``module`` by walking its children.

    A weight named ``model.layers.0.mlp.down_proj.weight`` goes to child
    ``model``: if that child has its own ``load_weights`` (``LlamaModel``, with
    its stacked q/k/v and gate/up names), it gets every ``model.*`` weight,
    names stripped of ``model.``; otherwise the walk goes down until it finds
    the parameter and calls its ``weight_loader``. Weights under
    ``skip_prefixes`` (a tied ``lm_head.``) are dropped; so are the rotary
    caches some checkpoints carry. A weight that matches nothing is an error.
    """

    ROTARY_EMBEDS_UNUSED_WEIGHTS = (
        "rotary_pos_emb.inv_freq",
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    def __init__(
        self,
        module: nn.Module,
        *,
        skip_prefixes: list[str] | None = None,
        skip_substrs: list[str] | None = None,
    ) -> None:
        self.module = module
        self.skip_prefixes = skip_prefixes or []
        self.skip_substrs = [*(skip_substrs or []), *self.ROTARY_EMBEDS_UNUSED_WEIGHTS]

    def load_weights(self, weights: WeightsIter) -> set[str]:
        """The names of the parameters loaded (this module's names)."""
        return set(self._load_module("", self.module, weights))

    def _can_skip(self, qualname: str) -> bool:
        return any(qualname.startswith(p) for p in self.skip_prefixes) or any(
            s in qualname for s in self.skip_substrs
        )

    @staticmethod
    def _groupby_prefix(weights: WeightsIter) -> Iterator[tuple[str, WeightsIter]]:
        """Consecutive weights by their first name component, the rest of the name kept."""
        parts = ((name.split(".", 1), data) for name, data in weights)
        for prefix, group in itertools.groupby(parts, key=lambda x: x[0][0]):
            yield prefix, ((p[1] if len(p) == 2 else "", data) for p, data in group)

    def _load_module(self, base: str, module: nn.Module, weights: WeightsIter) -> Iterator[str]:
        if isinstance(module, PPMissingLayer):
            return  # another pipeline stage's weights
        if module is not self.module and callable(getattr(module, "load_weights", None)):
            loaded = module.load_weights(weights)  # type: ignore[operator]
            yield from (maybe_prefix(base, name) for name in loaded)
            return
        children = dict(module.named_children())
        params = dict(module.named_parameters(recurse=False))
        for child, child_weights in self._groupby_prefix(weights):
            qualname = maybe_prefix(base, child)
            if child in children:
                if not self._can_skip(qualname + "."):
                    yield from self._load_module(qualname, children[child], child_weights)
            elif child in params:
                if not self._can_skip(qualname):
                    yield from self._load_param(qualname, params[child], child_weights)
            elif not (self._can_skip(qualname + ".") or self._can_skip(qualname)):
                raise ValueError(
                    f"There is no module or parameter named {qualname!r} "
                    f"in {type(self.module).__name__}"
                )

    def _load_param(
        self, qualname: str, param: nn.Parameter, weights: WeightsIter
    ) -> Iterator[str]:
        for rest, data in weights:
            if rest:
                raise ValueError(
                    f"Attempted to load nested weight {qualname}.{rest!r} "
                    f"into a single parameter {qualname!r}"
                )
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, data)
            yield qualname
