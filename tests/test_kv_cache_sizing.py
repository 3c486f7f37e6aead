"""Sizing the KV cache at start-up, with vLLM 0.22.0's helpers and check.

The ideas of vLLM's tests/v1/core/test_kv_cache_utils.py
(``get_kv_cache_configs``, ``estimate_max_model_len``,
``get_max_concurrency_for_kv_cache_config``) with vLLM's signatures, and the
start-up check: the engine refuses to start when its pool, after
``num_gpu_blocks_override``, cannot hold one ``max_model_len`` request.
"""

from __future__ import annotations

import re

import pytest
import torch

from tracevllm import LLM, SamplingParams
from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from tracevllm.core.kv_cache_utils import (
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    generate_scheduler_kv_cache_config,
    get_kv_cache_configs,
    get_max_concurrency_for_kv_cache_config,
)
from tracevllm.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
)

GiB_bytes = 1 << 30


def make_vllm_config(max_model_len: int, num_gpu_blocks_override: int | None = None) -> VllmConfig:
    model_config = ModelConfig(
        model="fake",
        hf_config={"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 32768},
        max_model_len=max_model_len,
    )
    cache_config = CacheConfig(block_size=16, num_gpu_blocks_override=num_gpu_blocks_override)
    return VllmConfig(model_config, cache_config, SchedulerConfig(max_model_len=max_model_len))


def new_kv_cache_spec(num_kv_heads: int = 2, head_size: int = 64) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float32
    )


# Bytes of one block of one layer of new_kv_cache_spec(): K and V, 16 tokens.
PAGE = 2 * 16 * 2 * 64 * 4


def test_page_size_and_max_memory() -> None:
    spec = new_kv_cache_spec()
    assert spec.page_size_bytes == PAGE
    assert FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32") == (
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    )
    # 33 tokens take 3 blocks.
    assert spec.max_memory_usage_bytes(make_vllm_config(33)) == 3 * PAGE


@pytest.mark.parametrize(("max_model_len", "want"), [(16385, 16384), (16383, 16383)])
def test_estimate_max_model_len(max_model_len: int, want: int) -> None:
    """vLLM's case: 32 layers of 32 KV heads x 128, fp16: 16384 tokens need 8 GiB."""
    vllm_config = make_vllm_config(max_model_len)
    kv_cache_spec = {
        f"layer_{i}": FullAttentionSpec(
            block_size=16, num_kv_heads=32, head_size=128, dtype=torch.float16
        )
        for i in range(32)
    }
    assert estimate_max_model_len(vllm_config, kv_cache_spec, 8 * GiB_bytes) == want
    assert vllm_config.model_config.max_model_len == max_model_len  # restored
    with pytest.raises(ValueError, match=rf"max seq len \({max_model_len}\)") as err:
        check_enough_kv_cache_memory(vllm_config, kv_cache_spec, 8 * GiB_bytes - 1)
    assert "estimated maximum model length is" in str(err.value)


def test_get_max_concurrency_for_kv_cache_config() -> None:
    vllm_config = make_vllm_config(16384)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=32, head_size=128, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=int(1024 * 1.5),
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer_{i}" for i in range(32)], spec)],
    )
    assert get_max_concurrency_for_kv_cache_config(vllm_config, config) == 1.5


def test_get_kv_cache_configs_one_group() -> None:
    vllm_config = make_vllm_config(16)
    specs = {"layer_1": new_kv_cache_spec(), "layer_2": new_kv_cache_spec()}
    (config,) = get_kv_cache_configs(vllm_config, [specs], [PAGE * 2 * 32])
    assert config == KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[
            KVCacheTensor(size=PAGE * 32, shared_by=["layer_1"]),
            KVCacheTensor(size=PAGE * 32, shared_by=["layer_2"]),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer_1", "layer_2"], new_kv_cache_spec())],
    )

    # Two workers: the fewer blocks for both, tensors shrunk to match.
    configs = get_kv_cache_configs(vllm_config, [specs, specs], [PAGE * 2 * 32, PAGE * 2 * 20])
    assert [c.num_blocks for c in configs] == [20, 20]
    assert all(t.size == PAGE * 20 for c in configs for t in c.kv_cache_tensors)


def test_get_kv_cache_configs_layers_of_two_sizes() -> None:
    """A draft model's layers beside the target's: one group, one block table,
    a block is one page of every layer; the scheduler sees one layer's spec."""
    vllm_config = make_vllm_config(16)
    small, big = new_kv_cache_spec(), new_kv_cache_spec(num_kv_heads=4)
    specs = {"layer_1": big, "draft_model.layer_1": small}
    (config,) = get_kv_cache_configs(vllm_config, [specs], [(PAGE * 3) * 10])
    assert config.num_blocks == 10
    assert isinstance(config.kv_cache_groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    assert [t.size for t in config.kv_cache_tensors] == [2 * PAGE * 10, PAGE * 10]
    scheduler_config = generate_scheduler_kv_cache_config([config])
    assert scheduler_config.kv_cache_groups[0].kv_cache_spec == big
    assert isinstance(config.kv_cache_groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)


def test_num_gpu_blocks_override_is_the_pool_the_check_judges() -> None:
    specs = {"layer_1": new_kv_cache_spec(), "layer_2": new_kv_cache_spec()}
    plenty = [GiB_bytes]
    # 256 tokens need 16 blocks: an override of 16 is enough, and is the pool.
    (config,) = get_kv_cache_configs(make_vllm_config(256, 16), [specs], plenty)
    assert config.num_blocks == 16
    assert all(t.size == PAGE * 16 for t in config.kv_cache_tensors)
    # 257 tokens need 17: refused, though memory would hold thousands of blocks.
    with pytest.raises(ValueError) as err:
        get_kv_cache_configs(make_vllm_config(257, 16), [specs], plenty)
    message = str(err.value)
    assert "To serve at least one request with the model's max seq len (257)" in message
    assert "That is 17 KV cache blocks; the pool has 16." in message
    assert "the estimated maximum model length is 256." in message
    # Without the override, the memory decides.
    with pytest.raises(ValueError, match=r"max seq len \(257\).*the pool has 16\."):
        get_kv_cache_configs(make_vllm_config(257), [specs], [PAGE * 2 * 16])
    with pytest.raises(ValueError, match="No available memory"):
        get_kv_cache_configs(make_vllm_config(16), [specs], [0])


# --- the engine ---------------------------------------------------------------------


def test_engine_refuses_to_start_when_one_request_cannot_fit(tiny_model_dir: str) -> None:
    """vLLM 0.22.0 refuses to start rather than refuse each request: 16 blocks
    of 16 tokens cannot hold one request of the tiny model's 512 tokens."""
    from tracevllm.worker import worker

    live = worker._PROCESS_THREADS["live"]  # engines other tests left open, if any
    with pytest.raises(ValueError) as err:
        LLM(model=tiny_model_dir, num_gpu_blocks_override=16, enable_multiprocessing=False)
    # The failed start shut its worker down: the in-process engine gave the
    # process its thread count back (mutation caught: no shutdown in
    # EngineCore.__init__ -> a live worker left counted).
    assert worker._PROCESS_THREADS["live"] == live
    message = str(err.value)
    assert "max seq len (512)" in message
    assert "That is 32 KV cache blocks; the pool has 16." in message
    assert "the estimated maximum model length is 256." in message
    assert "decreasing `max_model_len`" in message

    # As it says: max_model_len 256 starts, and serves.
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(
        model=tiny_model_dir,
        num_gpu_blocks_override=16,
        max_model_len=256,
        enable_multiprocessing=False,
    ) as llm:
        assert llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.num_blocks == 16
        assert len(llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_engine_process_says_why_it_did_not_start(tiny_model_dir: str) -> None:
    """The same refusal from the engine's own process reaches the caller."""
    with pytest.raises(RuntimeError, match=re.escape("max seq len (512)")):
        LLM(model=tiny_model_dir, num_gpu_blocks_override=16, enable_multiprocessing=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"block_size": True}, TypeError, "block_size must be an int, got bool"),
        ({"num_gpu_blocks_override": 2.5}, TypeError, "num_gpu_blocks_override must be an int"),
        ({"num_gpu_blocks_override": True}, TypeError, "num_gpu_blocks_override must be an int"),
        ({"num_gpu_blocks_override": 1}, ValueError, "at least 2"),
        ({"kv_cache_memory_bytes": "1GiB"}, TypeError, "kv_cache_memory_bytes must be an int"),
        ({"kv_cache_memory_bytes": 0}, ValueError, "kv_cache_memory_bytes must be positive"),
    ],
)
def test_cache_config_sizes_are_checked_at_the_entry(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    """What sizes the pool is refused before any model loads, naming the field."""
    with pytest.raises(error, match=match):
        CacheConfig(**kwargs)  # type: ignore[arg-type]


def test_a_failed_start_raises_its_own_error_when_the_shutdown_fails_too(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers' shutdown after a failed start is best effort: if it
    raises, the start's own error still reaches the caller (mutation caught:
    the shutdown unguarded -> the RuntimeError below instead)."""
    from tracevllm.executor.uniproc_executor import UniProcExecutor
    from tracevllm.worker import worker

    def broken_shutdown(self: UniProcExecutor) -> None:
        worker.release_process_threads()  # what the real one gives back
        raise RuntimeError("shutdown broke")

    monkeypatch.setattr(UniProcExecutor, "shutdown", broken_shutdown)
    with pytest.raises(ValueError, match="max seq len"):
        LLM(model=tiny_model_dir, num_gpu_blocks_override=16, enable_multiprocessing=False)
