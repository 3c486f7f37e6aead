"""Functions sent to every rank by ``collective_rpc`` (called as ``f(worker)``).

Their own small module: a worker imports it to unpickle the function, and a
test module's imports (the ``LLM``, pytest's fixtures) have no place there.
"""

from __future__ import annotations

from typing import Any

import torch


def _layer_weight(module: Any, in_features: int) -> torch.Tensor:
    """The weight a linear layer multiplies by, ``[out, in]``, read back through
    the layer's own matmul (on CPU the weight is packed for oneDNN and the
    plain parameter dropped): ``I @ W.T`` is exact."""
    from tracevllm.model_executor.layers.utils import cpu_unquantized_gemm

    dtype = next(iter(module.parameters())).dtype
    eye = torch.eye(in_features, dtype=dtype)
    return cpu_unquantized_gemm(module, eye, module.weight, None).t()


def rank_shards(worker: Any) -> dict[str, Any]:
    """This rank's weights (shape, row sums, column sums, in float64) and KV
    cache tensors: what ``collective_rpc`` brings back from each rank."""
    from tracevllm.distributed.parallel_state import get_tp_group
    from tracevllm.model_executor.layers.linear import LinearBase
    from tracevllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model = worker.get_model()
    weights: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                in_features = getattr(module, "input_size_per_partition", module.input_size)
                weights[f"{name}.weight"] = _layer_weight(module, in_features)
            elif isinstance(module, ParallelLMHead):
                weights[f"{name}.weight"] = _layer_weight(module, module.embedding_dim)
        for name, param in model.named_parameters():
            if param.numel() > 0 and name not in weights:
                weights[name] = param.detach()
    summary = {
        name: (
            tuple(w.shape),
            w.double().sum(-1) if w.dim() == 2 else w.double(),
            w.double().sum(0) if w.dim() == 2 else None,
        )
        for name, w in weights.items()
    }
    specs = worker.get_kv_cache_spec()
    return {
        "tp_rank": get_tp_group().rank_in_group,
        "weights": summary,
        "kv_caches": [
            (tuple(t.shape), t.numel() * t.element_size()) for t in worker.model_runner.kv_caches
        ],
        "kv_heads": sorted({spec.num_kv_heads for spec in specs.values()}),
    }


def sleep_then(worker: Any, seconds: float, value: Any) -> Any:
    """``value``, after ``seconds``: a call that outlasts its timeout."""
    import time

    time.sleep(seconds)
    return value
