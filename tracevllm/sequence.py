"""What one pipeline stage hands the next.

Mirrors vllm/sequence.py (``IntermediateTensors``): the hidden states and the
residual a non-last pipeline stage returns instead of logits, sent to the next
stage with ``send_tensor_dict``. Left out: the KV-connector output it also
carries in vLLM.
"""

from __future__ import annotations

from collections.abc import ItemsView
from dataclasses import dataclass
from typing import overload

import torch


@dataclass
class IntermediateTensors:
    """A dict of tensors by name (``"hidden_states"``, ``"residual"``), each
    ``[num_tokens, ...]``; slicing one slices every tensor's tokens."""

    tensors: dict[str, torch.Tensor]

    @overload
    def __getitem__(self, key: str) -> torch.Tensor: ...

    @overload
    def __getitem__(self, key: slice) -> IntermediateTensors: ...

    def __getitem__(self, key: str | slice) -> torch.Tensor | IntermediateTensors:
        if isinstance(key, str):
            return self.tensors[key]
        return IntermediateTensors({k: v[key] for k, v in self.tensors.items()})

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def items(self) -> ItemsView[str, torch.Tensor]:
        return self.tensors.items()

    def __len__(self) -> int:
        return len(self.tensors)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IntermediateTensors):
            return False
        if self.tensors.keys() != other.tensors.keys():
            return False
        return all(torch.equal(self.tensors[k], other.tensors[k]) for k in self.tensors)

    @staticmethod
    def empty_like(intermediate_tensors: IntermediateTensors) -> IntermediateTensors:
        return IntermediateTensors(
            {k: torch.empty_like(v) for k, v in intermediate_tensors.tensors.items()}
        )
