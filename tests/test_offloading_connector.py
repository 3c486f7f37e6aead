"""KV offloading: the OffloadingConnector's CPU tier keeps what the device pool evicts.

A tiny random-weight Llama with a 20-block device pool (160 tokens): a
64-token shared prefix is evicted from the engine's prefix cache by two
long prompts, and the next request with that prefix loads it back from the
tier (``--kv-offloading-size``) instead of recomputing it, with the greedy
tokens of an engine without the tier. A small tier never holds more blocks
than it has room for (its LRU evicts), and the flags are checked as vLLM's.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import pytest
import torch

from tests.utils import make_tiny_llama
from tracevllm import LLM, SamplingParams
from tracevllm.config import CacheConfig, KVTransferConfig
from tracevllm.engine.arg_utils import EngineArgs

BLOCK_SIZE = 8
NUM_GPU_BLOCKS = 20  # 160 tokens: the prefix and one long prompt do not fit together
MAX_MODEL_LEN = 160
PREFIX_LEN = 64  # 8 blocks
NUM_TOKENS = 8
LAYERS = 2
# One block of every layer: K and V, 2 KV heads of 16, fp32, 8 tokens, 2 layers.
BYTES_PER_BLOCK = 2 * 2 * 16 * 4 * BLOCK_SIZE * LAYERS


def _gib(num_blocks: int) -> float:
    """kv_offloading_size (GiB) for a tier of exactly ``num_blocks`` blocks."""
    return num_blocks * BYTES_PER_BLOCK / (1 << 30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("offload-tiny-llama"))
    return make_tiny_llama(path, seed=0, initializer_range=0.08)


def _tokens(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(5, 250, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def workload() -> list[list[list[int]]]:
    """Rounds of prompts, each round one generate call: the shared prefix's
    first request, two long prompts that fill the pool (evicting the
    prefix), then two requests with the prefix in one batch."""
    gen = torch.Generator().manual_seed(0)
    prefix = _tokens(PREFIX_LEN, gen)
    return [
        [prefix + _tokens(5, gen)],
        [_tokens(100, gen)],
        [_tokens(100, gen)],
        [prefix + _tokens(7, gen), prefix + _tokens(9, gen)],
    ]


def _llm(model_dir: str, **kwargs: Any) -> LLM:
    kwargs.setdefault("enable_multiprocessing", False)
    return LLM(
        model=model_dir,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_GPU_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        **kwargs,
    )


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _run(llm: LLM, rounds: list[list[list[int]]]) -> list[tuple[list[int], int]]:
    """(greedy tokens, num_cached_tokens) of every request, round after round."""
    results = []
    for prompts in rounds:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False
        )
        results += [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outputs]
    return results


def _scheduler_connector(llm: LLM) -> Any:
    """The in-process engine's scheduler-side connector."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _assert_pool_free(llm: LLM) -> None:
    stats = llm.llm_engine.engine_core.get_kv_cache_stats()
    assert stats["used"] == 0 and stats["free"] == stats["total"], stats


@pytest.fixture(scope="module")
def baseline(model_dir: str, workload: list[list[list[int]]]) -> list[tuple[list[int], int]]:
    with _llm(model_dir) as llm:
        return _run(llm, workload)


# ------------------------------------------------------------------ the flags
def test_offloading_flags_are_checked_and_become_the_connectors_config(model_dir: str) -> None:
    with pytest.raises(TypeError, match="kv_offloading_size must be a number of GiB, got bool"):
        CacheConfig(kv_offloading_size=True)
    with pytest.raises(TypeError, match="kv_offloading_size must be a number of GiB, got str"):
        CacheConfig(kv_offloading_size="1")  # type: ignore[arg-type]
    for bad in (math.nan, math.inf, 0, -1.0):
        with pytest.raises(ValueError, match="kv_offloading_size must be a positive, finite"):
            CacheConfig(kv_offloading_size=bad)
    with pytest.raises(TypeError, match="kv_offloading_backend must be a string, got int"):
        CacheConfig(kv_offloading_backend=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must be one of \['native', 'lmcache'\], got 'nixl'"):
        CacheConfig(kv_offloading_backend="nixl")
    with pytest.raises(ValueError, match="tracevllm does not have: use 'native'"):
        CacheConfig(kv_offloading_size=1.0, kv_offloading_backend="lmcache")

    # vLLM's: the size in GiB becomes the OffloadingConnector's cpu_bytes_to_use.
    config = EngineArgs(model=model_dir, kv_offloading_size=0.5).create_engine_config()
    transfer = config.kv_transfer_config
    assert transfer is not None
    assert transfer.kv_connector == "OffloadingConnector" and transfer.kv_role == "kv_both"
    assert transfer.kv_connector_extra_config == {"cpu_bytes_to_use": 0.5 * (1 << 30)}
    # Over a kv_transfer_config given too (as vLLM's), whose own keys stay;
    # the caller's object is left as it was.
    given = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_consumer",
        kv_connector_extra_config={"eviction_policy": "lru"},
    )
    config = EngineArgs(
        model=model_dir, kv_offloading_size=2, kv_transfer_config=given
    ).create_engine_config()
    assert config.kv_transfer_config is not None
    assert config.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert config.kv_transfer_config.kv_connector_extra_config == {
        "eviction_policy": "lru",
        "cpu_bytes_to_use": 2 * (1 << 30),
    }
    assert given.kv_connector == "ExampleConnector" and given.kv_role == "kv_consumer"
    assert EngineArgs(model=model_dir).create_engine_config().kv_transfer_config is None

    # tracevllm serve --kv-offloading-size 1.5 --kv-offloading-backend native
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-offloading-size", "1.5", "--kv-offloading-backend", "native"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.kv_offloading_size == 1.5 and engine_args.kv_offloading_backend == "native"
    assert parser.parse_args([]).kv_offloading_size is None
    for bad_args in (["--kv-offloading-backend", "disk"], ["--kv-offloading-size", "big"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad_args)
    # Prefix caching off: the tier is keyed by the prefix cache's block hashes.
    with pytest.raises(ValueError, match="needs prefix caching on"):
        _llm(model_dir, kv_offloading_size=_gib(8), enable_prefix_caching=False)
    with pytest.raises(TypeError, match=r"\['async_load'\] must be a bool, got 1"):
        _llm(model_dir, kv_transfer_config=_offload_config(8, async_load=1))


def _generate_bounded(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, max_steps: int
) -> list[Any]:
    """llm.generate, step by step, for at most ``max_steps`` engine steps: an
    engine that stops making progress fails here instead of stepping forever."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": prompt}, params)
    finished: dict[str, Any] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished_requests(), f"unfinished after {max_steps} engine steps"
    return [finished[f"b{i}"] for i in range(len(prompts))]


PREEMPT_PREFIX_LEN = 40


@pytest.fixture(scope="module")
def preempting_baseline(model_dir: str) -> tuple[list[list[int]], SamplingParams, list[list[int]]]:
    """Four prompts sharing a 40-token prefix, greedy 48 tokens, and their
    tokens (twice over) from an engine without the tier, which preempts."""
    gen = torch.Generator().manual_seed(3)
    prefix = _tokens(PREEMPT_PREFIX_LEN, gen)
    prompts = [prefix + _tokens(10 + i, gen) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with _llm(model_dir) as llm:
        outputs = _generate_bounded(llm, prompts, params, max_steps=2000)
        assert llm.llm_engine.num_preemptions > 0
        outputs += _generate_bounded(llm, prompts, params, max_steps=2000)
    return prompts, params, [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_load", [False, True], ids=["sync-load", "async-load"])
def test_preempted_requests_come_back_through_the_tier(
    model_dir: str,
    preempting_baseline: tuple[list[list[int]], SamplingParams, list[list[int]]],
    async_load: bool,
) -> None:
    """Four requests sharing a prefix, 48 tokens each, in a pool that cannot
    hold them all: they preempt one another, and each comes back by loading
    its blocks from the tier, with the tokens of the engine without the
    tier. Synchronous loads are admitted with their next chunk; with vLLM's
    asynchronous loads, requests that have loaded wait holding their blocks
    and once held every free block while nothing ran (the engine stepped
    without end: the bound below fails then; mutation caught: the
    scheduler's _free_loaded_waiting_request a no-op)."""
    prompts, params, expected = preempting_baseline
    config = _offload_config(200, async_load=async_load)
    with _llm(model_dir, kv_transfer_config=config) as llm:
        outputs = _generate_bounded(llm, prompts, params, max_steps=2000)
        assert llm.llm_engine.num_preemptions > 0
        # Again: now the prompts and their outputs come from the tier.
        outputs += _generate_bounded(llm, prompts, params, max_steps=2000)
        stats = _scheduler_connector(llm).get_kv_connector_stats()
        # Beyond the first prefix hit: the preempted requests' own blocks.
        assert stats["offload"]["loaded"] > PREEMPT_PREFIX_LEN // BLOCK_SIZE
        _assert_pool_free(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


# ------------------------------------------------- hits after device eviction
def _offload_config(num_blocks: int, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": num_blocks * BYTES_PER_BLOCK, **extra},
    }


@pytest.mark.timeout(300)  # a load never reported would hang its request
@pytest.mark.parametrize("async_load", [False, True], ids=["sync-load", "async-load"])
def test_an_evicted_prefix_is_loaded_back_from_the_tier_with_unchanged_output(
    model_dir: str,
    workload: list[list[list[int]]],
    baseline: list[tuple[list[int], int]],
    async_load: bool,
) -> None:
    """The device pool evicts the shared prefix (without the tier the next
    request with it computes all of it); with a tier big enough, it loads
    the prefix's 8 blocks back and computes only the rest, and every request
    gives the tokens of the engine without the tier. vLLM's asynchronous
    loads (``--kv-offloading-size``, the default) and synchronous ones
    (``async_load`` false)."""
    # The setup holds: without the tier, the prefix is gone from the pool.
    assert [cached for _, cached in baseline] == [0, 0, 0, 0, PREFIX_LEN]
    if async_load:
        kwargs: dict[str, Any] = {"kv_offloading_size": _gib(64)}  # the default
    else:
        kwargs = {"kv_transfer_config": _offload_config(64, async_load=False)}
    with _llm(model_dir, **kwargs) as llm:
        results = _run(llm, workload)
        stats = _scheduler_connector(llm).get_kv_connector_stats()
        _assert_pool_free(llm)
    assert [tokens for tokens, _ in results] == [tokens for tokens, _ in baseline]
    # The first request with the prefix after the eviction: 64 tokens from the
    # tier; the second (same step) hits those blocks in the device pool.
    assert [cached for _, cached in results] == [0, 0, 0, PREFIX_LEN, PREFIX_LEN]
    assert stats["connector_prefix_cache_stats"]["hits"] == PREFIX_LEN
    offload = stats["offload"]
    # Loaded once: the second request found the blocks in the prefix cache
    # (asynchronous: it waited for the first's load rather than loading again).
    assert offload["loaded"] == PREFIX_LEN // BLOCK_SIZE
    assert offload["evicted"] == 0  # room for everything
    # Write-through: each request's full blocks, once per distinct block.
    full_blocks = [(len(p) + NUM_TOKENS - 1) // BLOCK_SIZE for r in workload for p in r]
    shared = PREFIX_LEN // BLOCK_SIZE
    assert offload["stored"] == sum(full_blocks) - 2 * shared


def _fail_every_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process engine's tier worker: every load from the tier fails."""
    from tracevllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker.worker
    transfer_async = worker.transfer_async

    def fail_loads(job_id: int, spec: Any) -> bool:
        if spec[0].medium() == "CPU":  # from the tier: a load
            return False
        return bool(transfer_async(job_id, spec))

    monkeypatch.setattr(worker, "transfer_async", fail_loads)


@pytest.mark.timeout(300)
def test_a_failed_async_load_is_discarded_from_the_tier_and_recomputed(
    model_dir: str,
    workload: list[list[list[int]]],
    baseline: list[tuple[list[int], int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every load from the tier fails (policy "recompute", asynchronous
    loads): the request that found the evicted prefix there recomputes it,
    and its tokens are the engine's without the tier. Its failed blocks
    leave the tier: before, with no local hit, the request looked the tier
    up again, loaded again and failed again, without end (the bound fails
    then; mutation caught: discard a no-op)."""
    config = _offload_config(64, async_load=True)
    config["kv_load_failure_policy"] = "recompute"
    with _llm(model_dir, kv_transfer_config=config) as llm:
        _fail_every_load(monkeypatch)
        tokens = []
        for prompts in workload:
            outputs = _generate_bounded(llm, prompts, _greedy(), max_steps=300)
            tokens += [list(o.outputs[0].token_ids) for o in outputs]
        offload = _scheduler_connector(llm).get_kv_connector_stats()["offload"]
        _assert_pool_free(llm)
    assert tokens == [t for t, _ in baseline]
    # One load of the prefix's 8 blocks, failed and discarded, never retried.
    assert offload["loaded"] == offload["discarded"] == PREFIX_LEN // BLOCK_SIZE


@pytest.mark.timeout(300)
def test_after_a_failed_sync_load_the_prefix_is_computed_not_failed_again(
    model_dir: str,
    workload: list[list[list[int]]],
    baseline: list[tuple[list[int], int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Policy "fail" (vLLM's default), synchronous loads, every load from the
    tier failing: the request that loads the evicted prefix fails, and its
    blocks leave the tier, so the same prompt asked again is computed, with
    the engine's tokens without the tier (mutation caught: discard a no-op
    -> it loads and fails again)."""
    with _llm(model_dir, kv_transfer_config=_offload_config(64, async_load=False)) as llm:
        _fail_every_load(monkeypatch)
        tokens = []
        for prompts in workload[:3]:
            outputs = _generate_bounded(llm, prompts, _greedy(), max_steps=300)
            tokens += [list(o.outputs[0].token_ids) for o in outputs]
        assert tokens == [t for t, _ in baseline[:3]]
        failed = _generate_bounded(llm, workload[3][:1], _greedy(), max_steps=300)[0]
        assert failed.outputs[0].finish_reason == "error"
        again = _generate_bounded(llm, workload[3][:1], _greedy(), max_steps=300)[0]
        assert again.outputs[0].finish_reason == "length"
        assert list(again.outputs[0].token_ids) == baseline[3][0]
        offload = _scheduler_connector(llm).get_kv_connector_stats()["offload"]
        _assert_pool_free(llm)
    assert offload["loaded"] == offload["discarded"] == PREFIX_LEN // BLOCK_SIZE


@pytest.mark.timeout(300)  # a load never reported would hang its request
def test_loads_and_stores_are_spans_in_their_requests_traces(
    model_dir: str,
    workload: list[list[list[int]]],
    baseline: list[tuple[list[int], int]],
    tmp_path: Any,
) -> None:
    """The engine in its own process (the jobs travel to it pickled): the same
    tokens, one OffloadingConnector load span for the request that hit the
    tier and a store span per request that stored blocks, each under its
    request's llm_request span."""
    from tracevllm.tracing import SPANS_FILE
    from tracevllm.tracing.exporters import read_spans_jsonl

    with _llm(
        model_dir,
        kv_offloading_size=_gib(64),
        enable_multiprocessing=True,
        trace_detail="request",
        trace_dir=str(tmp_path),
    ) as llm:
        results = _run(llm, workload)
    assert results == baseline[:3] + [(baseline[3][0], PREFIX_LEN), baseline[4]]
    spans = read_spans_jsonl(str(tmp_path / SPANS_FILE))
    loads = [s for s in spans if s.name == "OffloadingConnector.wait_for_layer_load"]
    stores = [s for s in spans if s.name == "OffloadingConnector.save_kv_layer"]
    assert len(loads) == 1
    attrs = loads[0].attributes
    assert attrs["tracevllm.kv_transfer.connector"] == "OffloadingConnector"
    assert attrs["tracevllm.kv_transfer.direction"] == "load"
    assert attrs["tracevllm.kv_transfer.num_blocks"] == PREFIX_LEN // BLOCK_SIZE
    assert attrs["tracevllm.kv_transfer.num_tokens"] == PREFIX_LEN
    assert attrs["tracevllm.kv_transfer.num_layers"] == LAYERS
    assert attrs["tracevllm.kv_transfer.num_bytes"] == PREFIX_LEN // BLOCK_SIZE * BYTES_PER_BLOCK
    stored_blocks = sum(s.attributes["tracevllm.kv_transfer.num_blocks"] for s in stores)
    full_blocks = [(len(p) + NUM_TOKENS - 1) // BLOCK_SIZE for r in workload for p in r]
    assert stored_blocks == sum(full_blocks) - 2 * (PREFIX_LEN // BLOCK_SIZE)
    # Each under its request's llm_request span; every request stored blocks
    # (a request's decode blocks fill in later steps: a span per step).
    request_spans = {s.span_id for s in spans if s.name == "llm_request"}
    assert loads[0].parent_span_id in request_spans
    assert {s.parent_span_id for s in stores} == request_spans


# ------------------------------------------------------------ the tier's bound
@pytest.mark.timeout(300)  # a load never reported would hang its request
def test_the_tiers_bound_holds_and_its_lru_evicts_the_oldest(model_dir: str, tmp_path: Any) -> None:
    """A 12-block tier, in a file-backed region: five prompts of 5 blocks
    each go through it; it never holds more than 12 blocks, its region is
    the 12 blocks' bytes, and after the device pool is cleared the newest
    prompt still loads from the tier while the oldest (evicted) computes."""
    from tracevllm.distributed.kv_transfer import get_kv_transfer_group

    gen = torch.Generator().manual_seed(1)
    prompts = [_tokens(33, gen) for _ in range(5)]  # 33 + 8 tokens: 5 full blocks each
    num_tier_blocks = 12
    config = _offload_config(num_tier_blocks, cpu_offload_dir=str(tmp_path))
    with _llm(model_dir, kv_transfer_config=config) as llm:
        manager = _scheduler_connector(llm).connector_scheduler.manager
        region = get_kv_transfer_group().connector_worker.spec._handlers.region
        assert manager.num_blocks == num_tier_blocks
        assert region.file_backed and os.listdir(tmp_path) == []  # unlinked once mapped
        assert region.total_size_bytes == num_tier_blocks * BYTES_PER_BLOCK
        assert sum(t.numel() for t in region.tensors) == region.total_size_bytes
        expected = []
        for prompt in prompts:
            expected += _run(llm, [[prompt]])
            assert manager.get_num_stored_blocks() <= num_tier_blocks
        assert manager.stats.stored == 5 * 5
        assert manager.stats.evicted == 5 * 5 - num_tier_blocks
        assert manager.get_num_stored_blocks() == num_tier_blocks
        # The device pool forgets everything; the tier keeps the newest.
        assert llm.reset_prefix_cache()
        newest, oldest = _run(llm, [[prompts[-1]], [prompts[0]]])
        assert newest == (expected[-1][0], 32)  # 4 blocks before the last prompt token
        assert oldest == (expected[0][0], 0)
        assert manager.get_num_stored_blocks() <= num_tier_blocks
        _assert_pool_free(llm)


def test_a_discarded_block_goes_once_no_load_holds_it() -> None:
    """The tier drops the blocks behind a failed load (``discard``), but a
    block another load still reads goes only when that load completes; in
    between no lookup finds it, and the freed slots are reused, not leaked."""
    from tracevllm.kv_offload.base import ReqContext, make_offload_key
    from tracevllm.kv_offload.cpu.manager import CPUOffloadingManager

    manager, ctx = CPUOffloadingManager(num_blocks=4), ReqContext("r")
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(7)]
    assert manager.prepare_store(keys[:3], ctx) is not None
    manager.complete_store(keys[:3], ctx)
    manager.prepare_load(keys[:1], ctx)  # a load reads block 0
    manager.discard(keys[:2], ctx)
    # Mutation caught: lookup ignoring a deferred discard (block 0 found).
    assert [manager.lookup(k, ctx) for k in keys[:3]] == [False, False, True]
    assert manager.get_num_stored_blocks() == 2 and manager.stats.discarded == 1
    manager.complete_load(keys[:1], ctx)
    assert manager.get_num_stored_blocks() == 1 and manager.stats.discarded == 2
    # Three slots free again: four new blocks evict only the one left.
    assert manager.prepare_store(keys[3:], ctx) is not None
    manager.complete_store(keys[3:], ctx)
    assert manager.stats.evicted == 1 and manager.get_num_stored_blocks() == 4
