"""What a worker process holds, as its TracerProvider's resource attributes.

tracevllm's own (vLLM names a worker's ranks in its logs only). A worker's
place never changes while it runs, so it goes on the resource, once, and so
on every span the worker emits: its global, TP, PP and DP rank; the query
heads and KV heads of its attention layers, by index, as
``QKVParallelLinear`` shares them out (a KV head copied to several ranks when
there are fewer KV heads than TP ranks); the decoder layers of its pipeline
stage (``get_pp_indices``); and what one KV page costs it, over all its
layers. How many pages there are is known only once the engine has sized
the pool; the KV write span carries the cache tensor's shape. The Ranks view
(views/ranks.py) draws these. Left out: a draft model's layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracevllm.tracing.attributes import SpanAttributes

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig

# Resource attributes of a worker process (besides SpanAttributes.*_RANK).
Q_HEADS = "tracevllm.q_heads"
KV_HEADS = "tracevllm.kv_heads"
KV_HEAD_REPLICAS = "tracevllm.kv_head_replicas"
TOTAL_Q_HEADS = "tracevllm.total_q_heads"
TOTAL_KV_HEADS = "tracevllm.total_kv_heads"
LAYER_RANGE = "tracevllm.layer_range"  # [start, end): the stage's decoder layers
KV_BYTES_PER_BLOCK = "tracevllm.kv_cache.bytes_per_block"  # over all its layers

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def tp_head_indices(
    total_num_heads: int, total_num_kv_heads: int, tp_rank: int, tp_size: int
) -> tuple[list[int], list[int], int]:
    """The query heads and KV heads TP rank ``tp_rank`` holds, and on how
    many ranks each of its KV heads is (``QKVParallelLinear``: each rank has
    ``total / T`` query heads in rank order; a KV shard is
    ``tp_rank // num_kv_head_replicas``)."""
    num_heads = total_num_heads // tp_size
    if tp_size >= total_num_kv_heads:
        num_kv_heads, replicas = 1, tp_size // total_num_kv_heads
    else:
        num_kv_heads, replicas = total_num_kv_heads // tp_size, 1
    kv_shard = tp_rank // replicas
    q_heads = list(range(tp_rank * num_heads, (tp_rank + 1) * num_heads))
    kv_heads = list(range(kv_shard * num_kv_heads, (kv_shard + 1) * num_kv_heads))
    return q_heads, kv_heads, replicas


def worker_resource_attributes(vllm_config: VllmConfig, rank: int) -> dict[str, Any]:
    """Global rank ``rank``'s resource attributes (see the module docstring)."""
    from tracevllm.distributed.utils import get_pp_indices

    parallel_config = vllm_config.parallel_config
    model_config = vllm_config.model_config
    tp_size = parallel_config.tensor_parallel_size
    pp_size = parallel_config.pipeline_parallel_size
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    attributes: dict[str, Any] = {
        SpanAttributes.RANK: rank,
        SpanAttributes.TP_RANK: tp_rank,
        SpanAttributes.PP_RANK: pp_rank,
        SpanAttributes.DP_RANK: parallel_config.data_parallel_rank,
    }
    total_heads = model_config.get_num_attention_heads()
    total_kv_heads = model_config.get_total_num_kv_heads()
    q_heads, kv_heads, replicas = tp_head_indices(total_heads, total_kv_heads, tp_rank, tp_size)
    start, end = get_pp_indices(model_config.get_total_num_hidden_layers(), pp_rank, pp_size)
    # K and V, a page's slots, this rank's KV heads, each layer of its stage.
    page_bytes = (
        2
        * vllm_config.cache_config.block_size
        * len(kv_heads)
        * model_config.get_head_size()
        * _DTYPE_BYTES.get(model_config.torch_dtype, 4)
    )
    attributes.update(
        {
            Q_HEADS: q_heads,
            KV_HEADS: kv_heads,
            KV_HEAD_REPLICAS: replicas,
            TOTAL_Q_HEADS: total_heads,
            TOTAL_KV_HEADS: total_kv_heads,
            LAYER_RANGE: [start, end],
            KV_BYTES_PER_BLOCK: page_bytes * (end - start),
        }
    )
    return attributes
