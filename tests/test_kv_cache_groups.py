"""The KV cache groups of hybrid models, and their sizing, with vLLM 0.22.0's helpers.

The ideas of vLLM's tests/v1/core/test_kv_cache_utils.py for hybrid models
(``get_kv_cache_groups``, ``_get_kv_cache_groups_uniform_page_size``,
``get_kv_cache_config_from_groups``): one group per kind of attention, of
equal size, the tensors shared by one layer of each group; a sliding window's
memory bounded by its window, not by ``max_model_len``.
"""

from __future__ import annotations

import pytest
import torch

from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from tracevllm.core.kv_cache_sizing import get_request_block_limits, num_blocks_for_request
from tracevllm.core.kv_cache_utils import (
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
    get_kv_cache_groups,
    unify_kv_cache_spec_page_size,
)
from tracevllm.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from tracevllm.utils.math_utils import cdiv

BS = 16
PAGE = 2 * BS * 2 * 64 * 4  # K and V, 16 tokens, 2 KV heads x 64, fp32


def full(head_size: int = 64) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=head_size, dtype=torch.float32
    )


def sliding(window: int = 128, head_size: int = 64) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BS,
        num_kv_heads=2,
        head_size=head_size,
        dtype=torch.float32,
        sliding_window=window,
    )


def make_vllm_config(
    max_model_len: int = 4096, max_num_batched_tokens: int = 256, override: int | None = None
) -> VllmConfig:
    model_config = ModelConfig(
        model="fake",
        hf_config={"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 32768},
        max_model_len=max_model_len,
    )
    return VllmConfig(
        model_config,
        CacheConfig(block_size=BS, num_gpu_blocks_override=override),
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len),
    )


def layers(*specs: KVCacheSpec) -> dict[str, KVCacheSpec]:
    return {f"model.layers.{i}.self_attn.attn": spec for i, spec in enumerate(specs)}


def test_gemma2_alternating_layers_make_two_groups_sharing_tensors() -> None:
    """Sliding on even layers, full on odd: a group of each, the tensors shared
    by one layer of each group (a block id is one group's at a time)."""
    specs = layers(sliding(), full(), sliding(), full())
    groups = get_kv_cache_groups(make_vllm_config(), specs)
    assert [(type(g.kv_cache_spec), g.layer_names) for g in groups] == [
        (SlidingWindowSpec, ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]),
        (FullAttentionSpec, ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]),
    ]
    config = get_kv_cache_config_from_groups(make_vllm_config(), groups, 100 * 2 * PAGE + 5)
    assert config.num_blocks == 100  # each block is a page in 2 tensors
    assert [(t.size, t.shared_by) for t in config.kv_cache_tensors] == [
        (100 * PAGE, ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]),
        (100 * PAGE, ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"]),
    ]


def test_five_to_one_pattern_makes_a_group_per_layer_of_the_pattern() -> None:
    """Gemma-3's 5 sliding : 1 full: groups of one layer (the fewest of a kind)."""
    specs = layers(*([sliding()] * 5 + [full()]))
    groups = get_kv_cache_groups(make_vllm_config(), specs)
    assert len(groups) == 6
    assert [len(g.layer_names) for g in groups] == [1] * 6
    assert sum(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups) == 5


def test_near_equal_counts_are_padded_not_split(caplog: pytest.LogCaptureFixture) -> None:
    """12 sliding + 13 full: within 1.5x, so groups of 13 (one sliding slot
    padded), not a group per sliding layer; layer i goes to group i % n."""
    specs = layers(*([sliding()] * 12 + [full()] * 13))
    groups = get_kv_cache_groups(make_vllm_config(), specs)
    assert [len(g.layer_names) for g in groups] == [12, 13]
    assert "Add 1 padding layers" in caplog.text
    specs = layers(*([sliding()] * 4 + [full()] * 2))  # 2x: groups of 2
    groups = get_kv_cache_groups(make_vllm_config(), specs)
    assert [g.layer_names for g in groups][:2] == [
        ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"],
        ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
    ]


def test_uniform_models_keep_one_group() -> None:
    """Every layer alike (Mistral: all sliding) is one group; one window with
    different head sizes too (a uniform-type group)."""
    groups = get_kv_cache_groups(make_vllm_config(), layers(sliding(), sliding()))
    assert len(groups) == 1 and groups[0].kv_cache_spec == sliding()
    groups = get_kv_cache_groups(make_vllm_config(), layers(sliding(), sliding(head_size=32)))
    assert len(groups) == 1 and isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    # Different windows are different kinds: two groups.
    groups = get_kv_cache_groups(make_vllm_config(), layers(sliding(64), sliding(128)))
    assert len(groups) == 2


def test_unify_page_size_by_block_size() -> None:
    """A layer with half the page takes twice the tokens per block."""
    specs = unify_kv_cache_spec_page_size(layers(full(64), sliding(head_size=32)))
    assert [s.block_size for s in specs.values()] == [16, 32]
    assert len({s.page_size_bytes for s in specs.values()}) == 1
    with pytest.raises(NotImplementedError, match="not divisible"):
        unify_kv_cache_spec_page_size(layers(full(64), sliding(head_size=48)))


def test_sliding_window_memory_is_bounded_by_its_window() -> None:
    """vLLM's max_admission_blocks_per_request: W - 1 + a chunk of tokens, +1
    for a window that starts mid-block, never more than max_model_len."""
    spec = sliding(window=128)
    assert spec.max_admission_blocks_per_request(256, 4096) == cdiv(127 + 256, BS) + 1
    assert spec.max_admission_blocks_per_request(256, 100) == cdiv(100, BS) + 1
    assert spec.max_memory_usage_bytes(make_vllm_config(4096, 256)) == 25 * PAGE
    assert full().max_memory_usage_bytes(make_vllm_config(4096, 256)) == 256 * PAGE


def test_start_up_check_counts_each_group() -> None:
    """A 4096-token model with one sliding and one full layer: the full group
    needs 256 blocks for one request, the sliding one 25; the pool must hold both."""
    specs = layers(sliding(), full())
    (config,) = get_kv_cache_configs(make_vllm_config(override=281), [specs], [1 << 40])
    assert config.num_blocks == 281
    with pytest.raises(ValueError, match="That is 281 KV cache blocks; the pool has 280"):
        get_kv_cache_configs(make_vllm_config(override=280), [specs], [1 << 40])
    # All sliding: 25 blocks are enough for a 4096-token request.
    (config,) = get_kv_cache_configs(
        make_vllm_config(override=25), [layers(sliding(), sliding())], [1 << 40]
    )
    assert config.num_blocks == 25


def test_request_block_limits() -> None:
    """What the entry checks a request against: per group, a block per 16
    tokens, capped for the sliding window."""
    vllm_config = make_vllm_config(4096, 256)
    groups = get_kv_cache_groups(vllm_config, layers(sliding(), full()))
    config = get_kv_cache_config_from_groups(vllm_config, groups, 1000 * 2 * PAGE)
    limits = get_request_block_limits(vllm_config, config)
    assert limits == [(BS, 25), (BS, 0)]
    assert num_blocks_for_request(limits, 100) == 7 + 7
    assert num_blocks_for_request(limits, 4000) == 25 + 250
    assert num_blocks_for_request([(BS, 0)], 4000) == 250  # one full group: as before
