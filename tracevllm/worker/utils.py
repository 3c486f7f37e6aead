"""Small helpers of the model runner.

Mirrors vllm/v1/worker/utils.py (``bind_kv_cache``). Left out: everything
else there (attention groups, multimodal and sequence-parallel helpers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tracevllm.model_executor.layers.attention import Attention


def bind_kv_cache(
    kv_caches: dict[str, torch.Tensor],
    forward_context: dict[str, Attention],
    runner_kv_caches: list[torch.Tensor],
) -> None:
    """Give each attention layer its KV cache, and the runner the list of them.

    The runner's list is in layer order (the order of ``kv_caches``, which the
    runner builds from the model's modules); vLLM sorts it by the layer index
    in the name, for models whose layers are not built in order.
    """
    assert len(runner_kv_caches) == 0
    runner_kv_caches.extend(kv_caches.values())
    for layer_name, kv_cache in kv_caches.items():
        forward_context[layer_name].kv_cache = kv_cache
