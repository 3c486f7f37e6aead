"""Lab 01 tests: compute_num_new_tokens, alone and driving the real Scheduler."""

from __future__ import annotations

import pytest
from _labkit import load

from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from tracevllm.core.kv_cache_utils import get_request_block_hasher, sha256
from tracevllm.core.sched import scheduler as scheduler_module
from tracevllm.core.sched.scheduler import Scheduler
from tracevllm.outputs import ModelRunnerOutput
from tracevllm.request import Request
from tracevllm.sampling_params import SamplingParams

compute_num_new_tokens = load(__file__, "compute_num_new_tokens")


def n(
    num_tokens: int,
    computed: int,
    budget: int,
    threshold: int = 0,
    max_model_len: int = 1024,
    chunked: bool = True,
) -> int:
    return compute_num_new_tokens(num_tokens, computed, budget, threshold, max_model_len, chunked)


# --- the function alone --------------------------------------------------------


def test_prefill_that_fits_is_scheduled_whole() -> None:
    assert n(num_tokens=10, computed=0, budget=64) == 10
    assert n(num_tokens=64, computed=0, budget=64) == 64  # exactly the budget


def test_decode_needs_one_token() -> None:
    # A prompt of 10 tokens with 3 outputs: 13 tokens, 12 with KV in the cache.
    assert n(num_tokens=13, computed=12, budget=64) == 1
    assert n(num_tokens=13, computed=12, budget=1) == 1


def test_prefix_cache_hits_are_not_recomputed() -> None:
    # 32 of a 40-token prompt were found in the prefix cache.
    assert n(num_tokens=40, computed=32, budget=64) == 8


def test_chunked_prefill_takes_what_the_budget_allows() -> None:
    assert n(num_tokens=100, computed=0, budget=16) == 16
    assert n(num_tokens=100, computed=96, budget=16) == 4  # the last chunk
    assert n(num_tokens=100, computed=40, budget=7) == 7  # what earlier requests left


def test_no_budget_left_means_nothing() -> None:
    assert n(num_tokens=10, computed=0, budget=0) == 0
    assert n(num_tokens=11, computed=10, budget=0) == 0


def test_long_prefill_token_threshold() -> None:
    assert n(num_tokens=100, computed=0, budget=64, threshold=8) == 8
    assert n(num_tokens=100, computed=96, budget=64, threshold=8) == 4
    assert n(num_tokens=100, computed=0, budget=5, threshold=8) == 5  # the budget is smaller
    assert n(num_tokens=100, computed=0, budget=64, threshold=0) == 64  # 0: no threshold


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    assert n(num_tokens=100, computed=0, budget=64, chunked=False) == 0
    assert n(num_tokens=100, computed=0, budget=100, chunked=False) == 100
    assert n(num_tokens=11, computed=10, budget=1, chunked=False) == 1
    # The threshold is applied first: a 100-token prompt cut to 8 fits in 10.
    assert n(num_tokens=100, computed=0, budget=10, threshold=8, chunked=False) == 8


def test_no_position_at_or_past_max_model_len() -> None:
    # Positions 0..62 may be computed when max_model_len is 64: the token at
    # position 63 is the last one a request can hold, and it is sampled.
    assert n(num_tokens=70, computed=60, budget=64, max_model_len=64) == 3
    assert n(num_tokens=70, computed=63, budget=64, max_model_len=64) == 0
    assert n(num_tokens=70, computed=66, budget=64, max_model_len=64) == 0  # never negative


@pytest.mark.parametrize("chunked", [True, False])
def test_against_a_brute_force_count(chunked: bool) -> None:
    """Count token by token: take the next token while every rule allows it."""
    for num_tokens in (1, 5, 17):
        for computed in range(num_tokens):
            for budget in (0, 1, 4, 16):
                for threshold in (0, 3):
                    for max_model_len in (8, 64):
                        wanted = num_tokens - computed
                        if threshold:
                            wanted = min(wanted, threshold)
                        if not chunked and wanted > budget:
                            expected = 0
                        else:
                            expected = 0
                            while (
                                expected < wanted
                                and expected < budget
                                and computed + expected < max_model_len - 1
                            ):
                                expected += 1
                        got = n(num_tokens, computed, budget, threshold, max_model_len, chunked)
                        assert got == expected, (
                            f"compute_num_new_tokens(num_tokens={num_tokens}, "
                            f"num_computed_tokens={computed}, token_budget={budget}, "
                            f"long_prefill_token_threshold={threshold}, "
                            f"max_model_len={max_model_len}, enable_chunked_prefill={chunked}) "
                            f"returned {got}, expected {expected}"
                        )


# --- driving the real scheduler ----------------------------------------------------

BLOCK_SIZE = 4
SAMPLED = 7


def make_scheduler(budget: int, threshold: int = 0, chunked: bool = True) -> Scheduler:
    model_config = ModelConfig(
        model="fake",
        hf_config={"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096},
        max_model_len=64,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE)
    cache_config.num_gpu_blocks = 64
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=budget if chunked else 64,
        max_num_seqs=16,
        max_model_len=64,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(VllmConfig(model_config, cache_config, scheduler_config))


def make_request(req_id: str, prompt_len: int, base: int) -> Request:
    params = SamplingParams(max_tokens=8, temperature=0)
    params.update_from_generation_config({}, 2)
    prompt = [base + i for i in range(prompt_len)]
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    return Request(req_id, prompt, params, block_hasher=hasher)


def step(sched: Scheduler) -> dict[str, int]:
    """schedule(), then a fake forward pass: one token for each request whose
    scheduled tokens reach its end (a partial prefill samples nothing)."""
    so = sched.schedule()
    req_ids = list(so.num_scheduled_tokens)
    sampled = [
        [SAMPLED] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
        for r in req_ids
    ]
    output = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
    sched.update_from_output(so, output)
    return dict(so.num_scheduled_tokens)


@pytest.fixture
def plugged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler calls the function under test for both of its passes."""
    monkeypatch.setattr(scheduler_module, "compute_num_new_tokens", compute_num_new_tokens)


@pytest.mark.usefixtures("plugged")
def test_scheduler_continuous_batching_with_chunked_prefill() -> None:
    sched = make_scheduler(budget=16)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 10, base=1000 * (i + 1)))
    # r0 whole, r1 chunked to what is left, r2 waits.
    assert step(sched) == {"r0": 10, "r1": 6}
    # Running first (r0 decodes, r1 finishes its prompt), then r2 with the rest.
    assert step(sched) == {"r0": 1, "r1": 4, "r2": 10}
    assert step(sched) == {"r0": 1, "r1": 1, "r2": 1}


@pytest.mark.usefixtures("plugged")
def test_scheduler_threshold_and_no_chunking() -> None:
    sched = make_scheduler(budget=64, threshold=4)
    sched.add_request(make_request("a", 10, base=1000))
    sched.add_request(make_request("b", 3, base=2000))
    assert [step(sched) for _ in range(3)] == [
        {"a": 4, "b": 3},
        {"a": 4, "b": 1},
        {"a": 2, "b": 1},
    ]

    sched = make_scheduler(budget=64, chunked=False)
    sched.add_request(make_request("a", 40, base=1000))
    sched.add_request(make_request("b", 30, base=2000))  # 40 + 30 > 64: b waits whole
    assert step(sched) == {"a": 40}
    assert step(sched) == {"a": 1, "b": 30}
