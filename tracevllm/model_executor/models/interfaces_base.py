"""What the engine asks of every generative model class.

Mirrors vllm/model_executor/models/interfaces_base.py (``VllmModel``,
``VllmModelForTextGeneration``) as typing protocols: a model class need not
inherit from anything but ``nn.Module`` to be served, it only needs these
methods (an out-of-tree model registered with ``ModelRegistry`` too). Left
out: the pooling and multimodal interfaces, the runtime checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from tracevllm.sequence import IntermediateTensors


class VllmModel(Protocol):
    """Built with ``cls(vllm_config=..., prefix=...)``; called with the flat
    batch's token ids and positions (and, on a later pipeline stage, what the
    stage before sent)."""

    def __call__(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> Any: ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def modules(self) -> Iterator[nn.Module]: ...


class VllmModelForTextGeneration(VllmModel, Protocol):
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_sampled, hidden_size]`` -> ``[num_sampled, vocab_size]``."""
        ...
