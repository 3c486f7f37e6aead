"""Lab 15 tests: the offload tier's lookup, by hand, against the definition on
random tiers, and behind the connector's real ``get_num_new_matched_tokens``."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from _labkit import load

from tracevllm.core.kv_cache_utils import get_request_block_hasher, sha256
from tracevllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
    RequestOffloadState,
)
from tracevllm.kv_offload.base import OffloadKey, ReqContext
from tracevllm.kv_offload.cpu.manager import CPUOffloadingManager
from tracevllm.request import Request
from tracevllm.sampling_params import SamplingParams

_lookup = load(__file__, "_lookup")
BS = 4


def make_scheduler(async_load: bool = False) -> OffloadingConnectorScheduler:
    """The connector's scheduler side over a real CPU tier of 64 blocks."""
    manager = CPUOffloadingManager(num_blocks=64)
    spec = SimpleNamespace(
        gpu_block_size=(BS,), extra_config={"async_load": async_load}, get_manager=lambda: manager
    )
    return OffloadingConnectorScheduler(spec)  # type: ignore[arg-type]


def make_status(
    num_tokens: int, local_blocks: int = 0, req_id: str = "r", num_output_tokens: int = 0
) -> RequestOffloadState:
    """A request of ``num_tokens`` tokens, the last ``num_output_tokens`` of
    them outputs (a request resumed after preemption has some), whose first
    ``local_blocks`` blocks the engine's own prefix cache holds. The same
    tokens give the same keys, however many of them are outputs."""
    tokens = [100 + i for i in range(num_tokens)]
    num_prompt_tokens = num_tokens - num_output_tokens
    request = Request(
        req_id,
        tokens[:num_prompt_tokens],
        SamplingParams(max_tokens=64),
        block_hasher=get_request_block_hasher(BS, sha256),
    )
    request.append_output_token_ids(tokens[num_prompt_tokens:])
    status = RequestOffloadState(req=request, req_context=ReqContext(req_id))
    status.update_offload_keys()
    status.num_locally_computed_tokens = local_blocks * BS
    return status


def put(sched: OffloadingConnectorScheduler, keys: list[OffloadKey], ready: bool = True) -> None:
    """Store blocks in the tier (``ready`` False: their write is still in flight)."""
    ctx = ReqContext("writer")
    assert sched.manager.prepare_store(keys, ctx) is not None
    if ready:
        sched.manager.complete_store(keys, ctx)


def lookup(sched: OffloadingConnectorScheduler, status: RequestOffloadState) -> int | None:
    return _lookup(sched, status)  # type: ignore[no-any-return]


def test_every_block_in_the_tier() -> None:
    # 18 tokens: 4 full blocks (tokens 0-15) and 2 more. The last token is
    # computed whatever happens (its logits), so all 4 blocks may be loaded.
    sched, status = make_scheduler(), make_status(18)
    put(sched, status.offload_keys)
    assert lookup(sched, status) == 16


def test_a_synchronous_load_leaves_the_last_tokens_block() -> None:
    # 16 tokens, 4 full blocks, all in the tier: the fourth holds the last
    # token, which must be computed in the same step: 3 blocks load.
    sched, status = make_scheduler(), make_status(16)
    put(sched, status.offload_keys)
    assert lookup(sched, status) == 12


def test_an_asynchronous_load_takes_every_full_block() -> None:
    # vLLM's way: the request waits for its load, then the scheduler
    # computes its last token again; every full block is loaded.
    sched, status = make_scheduler(async_load=True), make_status(16)
    put(sched, status.offload_keys)
    assert lookup(sched, status) == 16
    sched, status = make_scheduler(async_load=True), make_status(18)
    put(sched, status.offload_keys)
    assert lookup(sched, status) == 16  # full blocks only


def test_only_past_the_local_hit() -> None:
    # 26 tokens, 6 full blocks; the engine's prefix cache holds blocks 0-1,
    # the tier blocks 2-5 (not 0-1): the lookup starts at block 2.
    sched, status = make_scheduler(), make_status(26, local_blocks=2)
    put(sched, status.offload_keys[2:])
    assert lookup(sched, status) == 16
    # The tier holding blocks 0-1 too changes nothing: they are not loaded twice.
    sched, status = make_scheduler(), make_status(26, local_blocks=2)
    put(sched, status.offload_keys)
    assert lookup(sched, status) == 16


def test_the_readme_example() -> None:
    # 18 tokens, local hit block 0, the tier holds blocks 0, 1 and 2, not 3.
    sched, status = make_scheduler(), make_status(18, local_blocks=1)
    put(sched, status.offload_keys[:3])
    assert lookup(sched, status) == 8


def test_only_consecutive_blocks_from_the_first() -> None:
    sched, status = make_scheduler(), make_status(26)
    keys = status.offload_keys
    put(sched, [keys[0], keys[1], keys[3], keys[4]])  # block 2 is missing
    assert lookup(sched, status) == 8
    sched, status = make_scheduler(), make_status(26)
    put(sched, status.offload_keys[1:])  # block 0 is missing: nothing usable
    assert lookup(sched, status) == 0


def test_less_than_a_block_past_the_local_hit_is_not_loaded() -> None:
    # 8 tokens, 2 full blocks, the first a local hit. Synchronously only
    # block 0 may load (block 1 holds the last token): nothing to load.
    sched, status = make_scheduler(), make_status(8, local_blocks=1)
    put(sched, status.offload_keys)
    assert lookup(sched, status) == 0
    # Asynchronously block 1 may load.
    sched, status = make_scheduler(async_load=True), make_status(8, local_blocks=1)
    put(sched, status.offload_keys)
    assert lookup(sched, status) == 4
    # A prompt shorter than a block has nothing to look up.
    sched, status = make_scheduler(async_load=True), make_status(3)
    assert lookup(sched, status) == 0


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_request_with_outputs_looks_up_its_output_blocks_too(async_load: bool) -> None:
    # A request resumed after preemption: 10 prompt tokens and 8 outputs,
    # 18 tokens, 4 full blocks (the last two hold outputs), all in the tier
    # (stored while it ran). Its tokens are num_tokens, not its prompt's:
    # all 4 blocks load (the prompt's 10 tokens would allow 2).
    sched, status = make_scheduler(async_load), make_status(18, num_output_tokens=8)
    assert status.req.num_prompt_tokens == 10 and len(status.offload_keys) == 4
    put(sched, status.offload_keys)
    assert lookup(sched, status) == 16
    # 3 prompt tokens (no full block) and 10 outputs: 3 full blocks, the
    # last token (12) past them, so all 3 load either way (the prompt alone
    # has none).
    sched, status = make_scheduler(async_load), make_status(13, num_output_tokens=10)
    put(sched, status.offload_keys)
    assert lookup(sched, status) == 12


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_never_more_blocks_than_the_request_has_keys(async_load: bool) -> None:
    # The request gained 8 outputs (18 tokens, 4 full blocks) since its
    # keys were made (2, its prompt's): the tier holds all 4 blocks, but
    # only the 2 keyed ones may be looked up and loaded.
    sched, status = make_scheduler(async_load), make_status(10)
    status.req.append_output_token_ids(list(range(110, 118)))  # make_status(18)'s tokens
    assert status.req.num_tokens == 18 and len(status.offload_keys) == 2
    put(sched, make_status(18).offload_keys)
    assert lookup(sched, status) == 8
    # The keys end at the local hit: nothing to look up.
    sched, status = make_scheduler(async_load), make_status(10, local_blocks=2)
    status.req.append_output_token_ids(list(range(110, 118)))
    put(sched, make_status(18).offload_keys)
    assert lookup(sched, status) == 0


def test_an_empty_tier() -> None:
    sched, status = make_scheduler(), make_status(30)
    assert lookup(sched, status) == 0


def test_a_block_being_written_means_ask_again() -> None:
    # Blocks 0 and 2 are readable, block 1 is still being written.
    sched, status = make_scheduler(), make_status(26)
    keys = status.offload_keys
    put(sched, [keys[0], keys[2]])
    put(sched, [keys[1]], ready=False)
    assert lookup(sched, status) is None


def test_the_walk_goes_on_to_the_first_miss_and_no_further() -> None:
    # vLLM lets the manager see every block up to the first miss (a store
    # elsewhere may kick off its own lookups), even past one it must wait for.
    sched, status = make_scheduler(), make_status(30)  # 7 full blocks, 6 may load
    keys = status.offload_keys
    put(sched, [keys[0], keys[2], keys[4]])
    put(sched, [keys[1]], ready=False)  # keys[3] missing: the walk ends there
    asked: list[OffloadKey] = []
    real = sched.manager.lookup
    sched.manager.lookup = lambda key, ctx: asked.append(key) or real(key, ctx)  # type: ignore[method-assign]
    assert lookup(sched, status) is None
    assert asked == keys[:4]


def test_blocks_another_request_is_loading() -> None:
    sched, status = make_scheduler(async_load=True), make_status(18)
    keys = status.offload_keys
    put(sched, keys)
    sched._blocks_being_loaded.add(keys[2])
    assert lookup(sched, status) is None  # wait for that load
    # A block being loaded that this request would not load does not matter:
    # past the first miss,
    sched, status = make_scheduler(async_load=True), make_status(26)
    keys = status.offload_keys
    put(sched, keys[:3])
    sched._blocks_being_loaded.add(keys[4])
    assert lookup(sched, status) == 12
    # or before the local hit.
    sched, status = make_scheduler(async_load=True), make_status(26, local_blocks=1)
    keys = status.offload_keys
    put(sched, keys[1:3])
    sched._blocks_being_loaded.add(keys[0])
    assert lookup(sched, status) == 8


def definition(
    num_tokens: int,
    local: int,
    state: list[str],
    loading: set[int],
    async_load: bool,
) -> int | None:
    """The rule, block by block: ``state[i]`` is block i's in the tier
    ("ready", "writing" or "absent"); ``loading`` the blocks another request
    is loading; ``local`` the local hit in blocks."""
    last = num_tokens // BS if async_load else (num_tokens - 1) // BS  # blocks that may load
    if last - local < 1:
        return 0
    hits, wait = 0, False
    for i in range(local, last):
        if state[i] == "absent":
            break
        wait = wait or state[i] == "writing"
        hits += 1
    if wait:
        return None
    if hits and loading & set(range(local, local + hits)):
        return None
    return hits * BS


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_random_tiers_against_the_definition(async_load: bool) -> None:
    rng = random.Random(15 + async_load)
    for trial in range(300):
        num_tokens = rng.randrange(1, 60)
        num_output_tokens = rng.choice([0, rng.randrange(0, num_tokens)])
        num_blocks = num_tokens // BS
        local = rng.randrange(0, max((num_tokens - 1) // BS, 0) + 1)
        state = [
            rng.choice(["ready", "ready", "ready", "writing", "absent"]) for _ in range(num_blocks)
        ]
        loading = {i for i in range(num_blocks) if rng.random() < 0.08}
        sched = make_scheduler(async_load)
        status = make_status(num_tokens, local, f"r{trial}", num_output_tokens)
        keys = status.offload_keys
        ready = [keys[i] for i in range(num_blocks) if state[i] == "ready"]
        writing = [keys[i] for i in range(num_blocks) if state[i] == "writing"]
        if ready:
            put(sched, ready)
        if writing:
            put(sched, writing, ready=False)
        sched._blocks_being_loaded.update(keys[i] for i in loading)
        want = definition(num_tokens, local, state, loading, async_load)
        got = lookup(sched, status)
        assert got == want, (
            f"{num_tokens} tokens ({num_output_tokens} outputs), local hit {local} blocks, "
            f"tier {state}, "
            f"being loaded {sorted(loading)}: got {got}, expected {want}"
        )


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_the_connector_admits_a_request_with_your_lookup(
    async_load: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler asks the connector's get_num_new_matched_tokens, which
    asks the lookup: installed as the method, yours decides what the
    request loads (and whether it waits for it)."""
    monkeypatch.setattr(OffloadingConnectorScheduler, "_lookup", _lookup)
    sched = make_scheduler(async_load)
    prompt = [100 + i for i in range(24)]  # 6 full blocks; token 23, the last, in block 5
    request = Request(
        "a", prompt, SamplingParams(max_tokens=4), block_hasher=get_request_block_hasher(BS, sha256)
    )
    keys = make_status(24).offload_keys  # the same tokens: the same keys
    put(sched, keys[:5])
    # The engine's prefix cache holds block 0, the tier blocks 0-4: 1-4 load.
    assert sched.get_num_new_matched_tokens(request, BS) == (16, async_load)
    put(sched, keys[5:])
    # Block 5 too, asynchronously; synchronously it holds the last token.
    expected = 20 if async_load else 16
    assert sched.get_num_new_matched_tokens(request, BS) == (expected, async_load)
