"""Sizing the KV cache at start-up: how many blocks, and whether one
``max_model_len`` request fits.

Mirrors the sizing half of vllm/v1/core/kv_cache_utils.py
(``get_kv_cache_configs``, ``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``, ``generate_scheduler_kv_cache_config``,
``estimate_max_model_len``, ``check_enough_kv_cache_memory`` /
``_check_enough_kv_cache_memory``, ``get_max_concurrency_for_kv_cache_config``,
``max_memory_usage_bytes``, ``may_override_num_blocks``, ``get_num_blocks``).
vLLM keeps it in one file with the block bookkeeping; tracevllm keeps it
apart, and ``kv_cache_utils`` re-exports every vLLM name, so that code written
against vLLM imports them from where vLLM has them.

As vLLM 0.22.0, the engine refuses to start when the pool, after
``num_gpu_blocks_override``, cannot hold one ``max_model_len`` request, and
the error names the numbers. Which layers share a block table (the groups)
is kv_cache_groups.py's; a hybrid model's groups share the pool, one tensor
per layer of a group, shared by a layer of each group; each pipeline stage
gets the groups projected onto its own layers. Left out: DeepSeek-V4's
layouts and the auto-fit of ``max_model_len = -1``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING

from tracevllm.core.kv_cache_groups import (  # noqa: F401 (vLLM's names, re-exported)
    get_kv_cache_groups,
    get_uniform_page_size,
    is_kv_cache_spec_uniform,
)
from tracevllm.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from tracevllm.logger import init_logger
from tracevllm.utils.math_utils import cdiv

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig

logger = init_logger(__name__)

GiB_bytes = 1 << 30


def format_gib(b: int) -> str:
    """Bytes as GiB, two decimals (vLLM: utils/mem_utils.py)."""
    return f"{round(b / GiB_bytes, 2)}"


def max_memory_usage_bytes(vllm_config: VllmConfig, kv_cache_specs: Iterable[KVCacheSpec]) -> int:
    """The KV cache one ``max_model_len`` request takes in these layers."""
    return sum(spec.max_memory_usage_bytes(vllm_config) for spec in kv_cache_specs)


def _max_fitting_model_len(
    vllm_config: VllmConfig, memory_needed: Callable[[], int], available_memory: int
) -> int:
    """The largest max_model_len (at most the configured one) whose request
    fits in ``available_memory``, by binary search; 0 if not even one token
    does. ``memory_needed`` reads ``model_config.max_model_len``, which is set
    to each candidate in turn and restored after."""
    model_config = vllm_config.model_config
    original_max_model_len = model_config.get_max_model_len()

    def fits(model_len: int) -> bool:
        model_config.max_model_len = model_len
        return memory_needed() <= available_memory

    try:
        left, right = 1, original_max_model_len
        if not fits(left):
            return 0
        result = 1
        while left <= right:
            mid = (left + right) // 2
            if fits(mid):
                result, left = mid, mid + 1
            else:
                right = mid - 1
        return result
    finally:
        model_config.max_model_len = original_max_model_len


def estimate_max_model_len(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec], available_memory: int
) -> int:
    """The largest max_model_len whose request fits in ``available_memory``."""
    return _max_fitting_model_len(
        vllm_config,
        lambda: max_memory_usage_bytes(vllm_config, kv_cache_spec.values()),
        available_memory,
    )


# --8<-- [start:check_enough_kv_cache_memory]
def _check_enough_kv_cache_memory(
    available_memory: int,
    get_needed_memory: Callable[[], int],
    max_model_len: int,
    estimate_max_model_len: Callable[[int], int],
    bytes_per_block: int | None = None,
) -> None:
    """Refuse to start unless the cache holds one ``max_model_len`` request.

    vLLM's check, with vLLM's message; the knobs it names are tracevllm's
    (``kv_cache_memory_bytes``, ``num_gpu_blocks_override``), and with
    ``bytes_per_block`` it also gives the count in blocks, the unit the
    override is set in.
    """
    if available_memory <= 0:
        raise ValueError(
            "No available memory for the cache blocks. Try increasing "
            "`kv_cache_memory_bytes` (or `num_gpu_blocks_override`) when initializing "
            "the engine."
        )
    needed_memory = get_needed_memory()
    if needed_memory <= available_memory:
        return
    estimated_max_len = estimate_max_model_len(available_memory)
    estimated_msg = ""
    if estimated_max_len > 0:
        estimated_msg = (
            "Based on the available memory, "
            f"the estimated maximum model length is {estimated_max_len}. "
        )
    blocks_msg = ""
    if bytes_per_block:
        blocks_msg = (
            f"That is {cdiv(needed_memory, bytes_per_block)} KV cache blocks; the pool "
            f"has {available_memory // bytes_per_block}. "
        )
    raise ValueError(
        f"To serve at least one request with the model's max seq len "
        f"({max_model_len}), ({format_gib(needed_memory)} GiB KV "
        f"cache is needed, which is larger than the available KV cache "
        f"memory ({format_gib(available_memory)} GiB). {blocks_msg}{estimated_msg}"
        f"Try increasing `kv_cache_memory_bytes` (or `num_gpu_blocks_override`) "
        f"or decreasing `max_model_len` when initializing the engine."
    )


# --8<-- [end:check_enough_kv_cache_memory]


def check_enough_kv_cache_memory(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec], available_memory: int
) -> None:
    """Raise ValueError unless ``available_memory`` holds one ``max_model_len`` request."""
    if kv_cache_spec:
        _check_enough_kv_cache_memory(
            available_memory,
            lambda: max_memory_usage_bytes(vllm_config, kv_cache_spec.values()),
            vllm_config.model_config.get_max_model_len(),
            lambda am: estimate_max_model_len(vllm_config, kv_cache_spec, am),
        )


def may_override_num_blocks(vllm_config: VllmConfig, num_blocks: int) -> int:
    """``num_gpu_blocks_override``, if set, instead of what memory gives."""
    override = vllm_config.cache_config.num_gpu_blocks_override
    return override if override is not None else num_blocks


def get_num_blocks(
    vllm_config: VllmConfig, num_layers: int, available_memory: int, page_size: int
) -> int:
    """Blocks that fit when each block costs ``page_size`` in each of ``num_layers`` layers."""
    num_blocks = max(int(available_memory // page_size // num_layers), 0)
    return may_override_num_blocks(vllm_config, num_blocks)


def _is_uniform_type_group(kv_cache_groups: list[KVCacheGroupSpec]) -> bool:
    return len(kv_cache_groups) == 1 and isinstance(
        kv_cache_groups[0].kv_cache_spec, UniformTypeKVCacheSpecs
    )


def _pool_bytes_per_block(kv_cache_groups: list[KVCacheGroupSpec]) -> int:
    """What one block id costs across the model's KV cache tensors."""
    if _is_uniform_type_group(kv_cache_groups):
        return kv_cache_groups[0].kv_cache_spec.page_size_bytes
    group_size = max(len(g.layer_names) for g in kv_cache_groups)
    return get_uniform_page_size(g.kv_cache_spec for g in kv_cache_groups) * group_size


def _max_memory_usage_bytes_from_groups(
    vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec]
) -> int:
    """The KV cache one ``max_model_len`` request takes, in whole blocks of every layer."""
    if not kv_cache_groups:
        return 0
    if _is_uniform_type_group(kv_cache_groups):
        return kv_cache_groups[0].kv_cache_spec.max_memory_usage_bytes(vllm_config)
    group_size = max(len(g.layer_names) for g in kv_cache_groups)
    page_size = kv_cache_groups[0].kv_cache_spec.page_size_bytes
    blocks_needed = sum(
        cdiv(g.kv_cache_spec.max_memory_usage_bytes(vllm_config), page_size)
        for g in kv_cache_groups
    )
    return group_size * page_size * blocks_needed


def _estimate_max_model_len_from_groups(
    vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec], available_memory: int
) -> int:
    return _max_fitting_model_len(
        vllm_config,
        lambda: _max_memory_usage_bytes_from_groups(vllm_config, kv_cache_groups),
        available_memory,
    )


def get_kv_cache_config_from_groups(
    vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec], available_memory: int
) -> KVCacheConfig:
    """How many blocks fit, and the tensor each layer gets."""
    if not kv_cache_groups:
        # No KV cache; the BlockPool still needs its null block.
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups)
    if _is_uniform_type_group(kv_cache_groups):
        # Layers of different sizes: a tensor of its own size for each.
        uniform = kv_cache_groups[0].kv_cache_spec
        assert isinstance(uniform, UniformTypeKVCacheSpecs)
        num_blocks = may_override_num_blocks(
            vllm_config, available_memory // uniform.page_size_bytes
        )
        tensors = [
            KVCacheTensor(
                size=uniform.kv_cache_specs[name].page_size_bytes * num_blocks, shared_by=[name]
            )
            for name in kv_cache_groups[0].layer_names
        ]
    else:
        # group_size tensors, tensor i shared by layer i of every group: with
        # groups (full.0, full.1) and (sw.0, sw.1), full.0 and sw.0 share one.
        # A block id is in one group at a time, so they never meet in a page.
        group_size = max(len(g.layer_names) for g in kv_cache_groups)
        page_size = get_uniform_page_size(g.kv_cache_spec for g in kv_cache_groups)
        num_blocks = get_num_blocks(vllm_config, group_size, available_memory, page_size)
        tensors = [
            KVCacheTensor(
                size=page_size * num_blocks,
                shared_by=[g.layer_names[i] for g in kv_cache_groups if i < len(g.layer_names)],
            )
            for i in range(group_size)
        ]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=kv_cache_groups
    )


def get_max_concurrency_for_kv_cache_config(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> float:
    """How many ``max_model_len`` requests the pool holds at once (vLLM counts
    the null block in the pool)."""
    groups = kv_cache_config.kv_cache_groups
    num_layer_per_group = max(len(g.layer_names) for g in groups)
    max_memory_usage_per_request = num_layer_per_group * max_memory_usage_bytes(
        vllm_config, (g.kv_cache_spec for g in groups)
    )
    memory_per_block = groups[0].kv_cache_spec.page_size_bytes * num_layer_per_group
    num_block_per_request = cdiv(max_memory_usage_per_request, memory_per_block)
    return kv_cache_config.num_blocks / num_block_per_request


def _report_kv_cache_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    max_model_len = vllm_config.model_config.get_max_model_len()
    max_concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config)
    logger.info("KV cache size: %s tokens", f"{int(max_concurrency * max_model_len):,}")
    logger.info(
        "Maximum concurrency for %s tokens per request: %.2fx",
        f"{max_model_len:,}",
        max_concurrency,
    )


def _project_kv_cache_groups_to_worker(
    global_kv_cache_groups: list[KVCacheGroupSpec], worker_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """The whole model's groups cut down to the layers one worker holds (a
    pipeline stage holds only its own); a group may be left without layers."""
    projected_groups: list[KVCacheGroupSpec] = []
    for group in global_kv_cache_groups:
        worker_layer_names = [name for name in group.layer_names if name in worker_spec]
        group_spec = group.kv_cache_spec
        if worker_layer_names and isinstance(group_spec, UniformTypeKVCacheSpecs):
            group_spec = UniformTypeKVCacheSpecs(
                block_size=group_spec.block_size,
                kv_cache_specs={n: group_spec.kv_cache_specs[n] for n in worker_layer_names},
            )
        projected_groups.append(KVCacheGroupSpec(worker_layer_names, group_spec))
    return projected_groups


# --8<-- [start:get_kv_cache_configs]
def get_kv_cache_configs(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> list[KVCacheConfig]:
    """The KV cache config of each worker, from its layers' specs and memory.

    Every worker gets the same groups and the same number of blocks (the
    scheduler allocates one block id for all of them). The groups are made
    from the whole model's layers (every worker's specs merged), then each
    worker's are projected onto the layers it holds: the TP ranks of a stage
    hold the same layers, a pipeline stage only its own, so its tensors are
    only for them. With ``num_gpu_blocks_override`` the memory that counts is
    what the override's blocks take, so the start-up check judges the pool
    that will exist.
    """
    merged_kv_cache_specs: dict[str, KVCacheSpec] = {}
    for kv_cache_spec_one_worker in kv_cache_specs:
        for layer_name, layer_spec in kv_cache_spec_one_worker.items():
            assert merged_kv_cache_specs.setdefault(layer_name, layer_spec) == layer_spec, (
                f"Layer {layer_name} has different KV cache specs on different workers."
            )
    global_kv_cache_groups = get_kv_cache_groups(vllm_config, merged_kv_cache_specs)
    projected_groups_per_worker = [
        _project_kv_cache_groups_to_worker(global_kv_cache_groups, worker_spec)
        for worker_spec in kv_cache_specs
    ]
    override = vllm_config.cache_config.num_gpu_blocks_override
    if override is not None:
        adjusted_memory: list[int] = []
        for groups, avail_mem in zip(projected_groups_per_worker, available_memory):
            if not groups:
                adjusted_memory.append(avail_mem)
                continue
            bytes_per_block = _pool_bytes_per_block(groups)
            logger.info(
                "Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d",
                avail_mem // bytes_per_block,
                override,
            )
            adjusted_memory.append(override * bytes_per_block)
        available_memory = adjusted_memory

    for groups, avail_mem in zip(projected_groups_per_worker, available_memory):
        if groups:
            _check_enough_kv_cache_memory(
                avail_mem,
                partial(_max_memory_usage_bytes_from_groups, vllm_config, groups),
                vllm_config.model_config.get_max_model_len(),
                partial(_estimate_max_model_len_from_groups, vllm_config, groups),
                bytes_per_block=_pool_bytes_per_block(groups),
            )

    kv_cache_configs = []
    for groups, worker_spec, avail_mem in zip(
        projected_groups_per_worker, kv_cache_specs, available_memory
    ):
        assert sum(len(g.layer_names) for g in groups) == len(worker_spec), (
            "Some layers are not assigned to any group."
        )
        kv_cache_configs.append(get_kv_cache_config_from_groups(vllm_config, groups, avail_mem))
    # The fewest blocks any worker has, for all (tensors shrunk to match).
    min_num_blocks = min(config.num_blocks for config in kv_cache_configs)
    for config in kv_cache_configs:
        for tensor in config.kv_cache_tensors:
            tensor.size = tensor.size // config.num_blocks * min_num_blocks
        config.num_blocks = min_num_blocks
        if config.kv_cache_groups:
            _report_kv_cache_config(vllm_config, config)
    return kv_cache_configs


# --8<-- [end:get_kv_cache_configs]


def get_request_block_limits(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> list[tuple[int, int]]:
    """Per KV cache group: (block size, the most blocks one request holds in it).

    0 means no bound: full attention holds a block per ``block_size`` tokens
    of the request. A sliding window holds at most
    ``SlidingWindowSpec.max_admission_blocks_per_request``, however long the
    request (tracevllm's, for the entry's check that a request can fit).
    """
    max_num_batched_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    max_model_len = vllm_config.model_config.get_max_model_len()
    limits = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        cap = 0
        if isinstance(spec, SlidingWindowSpec):
            cap = spec.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        limits.append((spec.block_size, cap))
    return limits


def num_blocks_for_request(limits: list[tuple[int, int]], num_tokens: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens holds at once, every
    group together (they draw from one pool)."""
    return sum(
        cdiv(num_tokens, block_size) if cap == 0 else min(cdiv(num_tokens, block_size), cap)
        for block_size, cap in limits
    )


def generate_scheduler_kv_cache_config(kv_cache_configs: list[KVCacheConfig]) -> KVCacheConfig:
    """The config the scheduler's KV manager is built from: any worker's (they
    differ in layer names only), a uniform-type group's spec replaced by one
    of its layers' (the manager needs the kind of attention and the block size)."""
    assert all(c.num_blocks == kv_cache_configs[0].num_blocks for c in kv_cache_configs)
    config = copy.deepcopy(kv_cache_configs[0])
    for group in config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs):
            group.kv_cache_spec = next(iter(group.kv_cache_spec.kv_cache_specs.values()))
    return config
