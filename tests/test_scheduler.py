"""The scheduler, driven by hand-made requests and a fake model runner."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from tracevllm.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from tracevllm.core.kv_cache_utils import get_request_block_hasher, sha256
from tracevllm.core.sched.output import SchedulerOutput
from tracevllm.core.sched.scheduler import Scheduler
from tracevllm.core.sched.utils import check_stop
from tracevllm.engine import (
    EngineCoreEventType,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
)
from tracevllm.outputs import ModelRunnerOutput
from tracevllm.request import Request, RequestStatus
from tracevllm.sampling_params import SamplingParams

BS = 4
EOS = 2
TOKEN = 7  # what the fake model samples unless told otherwise
_prompt_base = itertools.count(1000, 1000)


def make_scheduler(
    num_gpu_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    include_finished_set: bool = False,
    speculative_config: SpeculativeConfig | None = None,
) -> Scheduler:
    model_config = ModelConfig(
        model="fake",
        hf_config={"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096},
        max_model_len=max_model_len,
    )
    cache_config = CacheConfig(block_size=BS, enable_prefix_caching=enable_prefix_caching)
    cache_config.num_gpu_blocks = num_gpu_blocks
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
    )
    return Scheduler(
        VllmConfig(
            model_config, cache_config, scheduler_config, speculative_config=speculative_config
        ),
        include_finished_set=include_finished_set,
    )


def make_request(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int = 16,
    arrival_time: float = 0.0,
    priority: int = 0,
    **kwargs: object,
) -> Request:
    if isinstance(prompt, int):  # a prompt that shares no prefix with another
        base = next(_prompt_base)
        prompt = [base + i for i in range(prompt)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)  # type: ignore[arg-type]
    params.update_from_generation_config({}, EOS)
    return Request(
        req_id,
        prompt,
        params,
        arrival_time=arrival_time,
        priority=priority,
        trace_headers={"traceparent": f"00-{req_id}"},
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def runner_output(
    sched: Scheduler, so: SchedulerOutput, sample: Callable[[str], int] = lambda _: TOKEN
) -> ModelRunnerOutput:
    """What the model runner returns: one token per request whose scheduled
    tokens reach its end, nothing for a partial prefill."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = sched.requests[req_id]
        done = req.num_computed_tokens >= req.num_tokens  # already advanced by schedule()
        sampled.append([sample(req_id)] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def step(
    sched: Scheduler, sample: Callable[[str], int] = lambda _: TOKEN
) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
    so = sched.schedule()
    return so, sched.update_from_output(so, runner_output(sched, so, sample))


def check_blocks(sched: Scheduler) -> None:
    """Free + held = usable, and each block's ref_cnt is its number of holders."""
    mgr = sched.kv_cache_manager
    pool = mgr.block_pool
    req_to_blocks = mgr.coordinator.single_type_managers[0].req_to_blocks
    holders: dict[int, int] = {}
    for blocks in req_to_blocks.values():
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    assert all(pool.blocks[i].ref_cnt == n for i, n in holders.items())
    assert pool.get_num_free_blocks() + len(holders) == pool.num_gpu_blocks - 1
    assert set(req_to_blocks) == {r.request_id for r in sched.running}


def outputs_of(eco: dict[int, EngineCoreOutputs]) -> dict[str, list[int]]:
    return {o.request_id: o.new_token_ids for e in eco.values() for o in e.outputs}


# --- budgets and limits ------------------------------------------------------


def test_token_budget_and_chunked_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 10))
    so, eco = step(sched)
    assert so.num_scheduled_tokens == {"r0": 10, "r1": 6}
    assert so.total_num_scheduled_tokens == 16
    assert outputs_of(eco) == {"r0": [TOKEN]}  # r1 is a partial prefill: nothing
    assert sched.requests["r1"].num_output_tokens == 0
    so, eco = step(sched)
    # Running first (decode r0, rest of r1), then r2 with what is left.
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 4, "r2": 10}
    assert so.total_num_scheduled_tokens == 15
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r2"]
    assert so.scheduled_cached_reqs.req_ids == ["r0", "r1"]
    assert outputs_of(eco) == {"r0": [TOKEN], "r1": [TOKEN], "r2": [TOKEN]}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 1}


def test_chunked_prefill_splits_long_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("long", 20))
    chunks = []
    for _ in range(3):
        so, eco = step(sched)
        chunks.append(so.num_scheduled_tokens["long"])
        if len(chunks) < 3:
            assert eco[0].outputs == []  # only stats
    assert chunks == [8, 8, 4]
    assert outputs_of(eco) == {"long": [TOKEN]}
    req = sched.requests["long"]
    assert req.num_computed_tokens == 20 and req.num_tokens == 21
    # 20 computed tokens fill 5 blocks; the sampled 21st gets its block next step.
    assert sched.kv_cache_manager.get_block_ids("long") == ([1, 2, 3, 4, 5],)


def test_long_prefill_token_threshold() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=4)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 3))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 4, "b": 3}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 4, "b": 1}
    so, eco = step(sched)
    assert so.num_scheduled_tokens == {"a": 2, "b": 1}
    assert "a" in outputs_of(eco)


def test_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=2))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert len(sched.running) == 2 and len(sched.waiting) == 1
    so, _ = step(sched)  # r0, r1 finish here (2 tokens)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"r2"}
    assert so.finished_req_ids == {"r0", "r1"}


def test_prefill_and_decode_in_one_step() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    step(sched)
    sched.add_request(make_request("b", 6))
    so, eco = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 6}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    new_b = so.scheduled_new_reqs[0]
    assert new_b.block_ids == ([3, 4],) and new_b.num_computed_tokens == 0
    cached = so.scheduled_cached_reqs
    assert cached.req_ids == ["a"] and cached.num_computed_tokens == [5]
    assert cached.new_block_ids == [None]  # a's 6th token fits in block 2
    assert cached.all_token_ids == {}  # a ran last step: the runner has its tokens
    assert outputs_of(eco) == {"a": [TOKEN], "b": [TOKEN]}
    assert so.step_id == 2


def test_without_chunked_prefill_too_long_prompt_waits() -> None:
    sched = make_scheduler(
        max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False
    )
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 10))
    sched.add_request(make_request("c", 3))  # would fit, but FCFS stops at b
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 10}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 10, "c": 3}


# --- preemption --------------------------------------------------------------


def test_fcfs_preempts_last_admitted_and_resumes_with_prefix_hit() -> None:
    # 7 usable blocks of 4. Three 7-token prompts take 2 blocks each.
    sched = make_scheduler(num_gpu_blocks=8)
    sched.add_request(make_request("A", 7, max_tokens=3))
    sched.add_request(make_request("B", [200 + i for i in range(7)]))
    sched.add_request(make_request("C", [300 + i for i in range(7)]))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"A": 7, "B": 7, "C": 7}
    check_blocks(sched)
    so, _ = step(sched)  # each decode fits in its 2nd block
    assert so.preempted_req_ids == set()
    c_blocks = sched.kv_cache_manager.get_block_ids("C")[0]

    # Position 8 needs a 3rd block each: A takes the last free one, B preempts C.
    so, eco = step(sched)
    assert so.preempted_req_ids == {"C"}
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    c = sched.requests["C"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.waiting.peek_request() is c
    assert [e.type for e in c.events] == [EngineCoreEventType.PREEMPTED]
    assert sched.running == [sched.requests["B"]]  # A finished (3 tokens) this step
    assert "A" not in sched.requests
    stats = eco[0].scheduler_stats
    assert stats is not None and stats.num_preempted_reqs == 1
    check_blocks(sched)

    # C comes back: its first block (tokens 0..3) was freed with its hash and not
    # reused, so it is a hit; its second block went to B and is recomputed.
    so, eco = step(sched)
    assert so.preempted_req_ids == set() and so.scheduled_new_reqs == []
    cached = so.scheduled_cached_reqs
    assert cached.req_ids == ["B", "C"] and cached.resumed_req_ids == {"C"}
    assert cached.all_token_ids == {"C": [300 + i for i in range(7)] + [TOKEN, TOKEN]}
    new_c = cached.new_block_ids[1]
    assert new_c is not None and new_c[0][0] == c_blocks[0] and len(new_c[0]) == 3
    assert cached.num_computed_tokens[1] == 4
    assert so.num_scheduled_tokens["C"] == 9 - 4
    stats = eco[0].scheduler_stats
    assert stats is not None
    assert (
        stats.prefix_cache_stats.preempted_requests,
        stats.prefix_cache_stats.preempted_hits,
    ) == (
        1,
        4,
    )
    assert outputs_of(eco)["C"] == [TOKEN]
    check_blocks(sched)

    while sched.has_unfinished_requests():
        step(sched)
        check_blocks(sched)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 7 and sched.kv_cache_manager.usage == 0.0


def _priority_setup(policy: str) -> tuple[Scheduler, SchedulerOutput]:
    """6 usable blocks, running [A (prio 0), B (prio 1), C (prio 0)], no free
    block, and only C needs a new one next step."""
    sched = make_scheduler(num_gpu_blocks=7, policy=policy)
    sched.add_request(make_request("A", 6, arrival_time=1.0, priority=0))
    sched.add_request(make_request("B", [200 + i for i in range(6)], arrival_time=2.0, priority=1))
    step(sched)
    sched.add_request(make_request("C", [300 + i for i in range(8)], arrival_time=3.0, priority=0))
    step(sched)
    assert [r.request_id for r in sched.running] == ["A", "B", "C"]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    return sched, sched.schedule()


def test_priority_preempts_lowest_priority() -> None:
    sched, so = _priority_setup("priority")
    # B was already scheduled this step: its tokens go back to the budget.
    assert so.preempted_req_ids == {"B"}
    assert so.num_scheduled_tokens == {"A": 1, "C": 1}
    assert so.scheduled_cached_reqs.req_ids == ["A", "C"]
    assert [r.request_id for r in sched.running] == ["A", "C"]
    assert sched.requests["B"].status == RequestStatus.PREEMPTED
    check_blocks(sched)


def test_fcfs_victim_is_the_request_itself() -> None:
    sched, so = _priority_setup("fcfs")
    # C is last: preempting "the last admitted" means giving up on C itself.
    assert so.preempted_req_ids == {"C"}
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert [r.request_id for r in sched.running] == ["A", "B"]
    check_blocks(sched)


def test_no_admission_in_a_step_with_preemption() -> None:
    """A step that preempted admits nothing from the waiting queue, even a
    request that would fit."""
    sched = make_scheduler(num_gpu_blocks=5, policy="priority")  # 4 usable blocks
    sched.add_request(make_request("A", 7, arrival_time=1.0, priority=0))
    sched.add_request(make_request("B", 7, arrival_time=2.0, priority=5))
    step(sched)
    step(sched)
    sched.add_request(make_request("E", 3, arrival_time=3.0, priority=1))
    so, _ = step(sched)  # A needs a 3rd block: B is preempted, one block stays free
    assert so.preempted_req_ids == {"B"} and so.num_scheduled_tokens == {"A": 1}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 1
    so, _ = step(sched)  # E (priority 1) goes before B (priority 5)
    assert so.num_scheduled_tokens == {"A": 1, "E": 3}
    assert [r.request_id for r in sched.waiting] == ["B"]


# --- stopping ----------------------------------------------------------------


def test_check_stop() -> None:
    def run(req: Request, tokens: list[int], max_model_len: int = 64) -> int:
        """Append tokens until check_stop says stop; return how many."""
        for n, t in enumerate(tokens, 1):
            req.append_output_token_ids(t)
            if check_stop(req, max_model_len):
                return n
        return -1

    r = make_request("eos", 3)
    assert run(r, [5, EOS, 6]) == 2
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert r.get_finished_reason() == FinishReason.STOP

    r = make_request("stop_id", 3, stop_token_ids=[42])
    assert run(r, [5, 42]) == 2 and r.stop_reason == 42
    assert r.status == RequestStatus.FINISHED_STOPPED

    r = make_request("max", 3, max_tokens=3)
    assert run(r, [5, 5, 5, 5]) == 3
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.stop_reason is None
    assert r.get_finished_reason() == FinishReason.LENGTH

    r = make_request("min", 3, min_tokens=3)
    assert run(r, [EOS, EOS, EOS]) == 3  # EOS ignored before 3 outputs

    r = make_request("ignore", 3, max_tokens=4, ignore_eos=True)
    assert run(r, [EOS, EOS, EOS, EOS]) == 4
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED

    r = make_request("model_len", 6)
    assert run(r, [5, 5, 5], max_model_len=8) == 2
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_through_scheduler() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("eos", 5))
    sched.add_request(make_request("stop", 5, stop_token_ids=[42]))
    sched.add_request(make_request("len", 5, max_tokens=2))
    sched.add_request(make_request("ignore", 5, max_tokens=3, ignore_eos=True))
    script = {"eos": [9, EOS], "stop": [42], "len": [9, 9], "ignore": [EOS, EOS, EOS]}
    counters = dict.fromkeys(script, 0)

    def sample(req_id: str) -> int:
        counters[req_id] += 1
        return script[req_id][counters[req_id] - 1]

    finished: dict[str, tuple[FinishReason | None, int | str | None, list[int]]] = {}
    tokens: dict[str, list[int]] = {k: [] for k in script}
    for _ in range(3):
        _, eco = step(sched, sample)
        for o in eco[0].outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finished[o.request_id] = (o.finish_reason, o.stop_reason, tokens[o.request_id])
                assert o.trace_headers == {"traceparent": f"00-{o.request_id}"}
            else:
                assert o.trace_headers is None
    assert finished == {
        "eos": (FinishReason.STOP, None, [9, EOS]),
        "stop": (FinishReason.STOP, 42, [42]),
        "len": (FinishReason.LENGTH, None, [9, 9]),
        "ignore": (FinishReason.LENGTH, None, [EOS, EOS, EOS]),
    }
    assert not sched.has_unfinished_requests() and sched.has_finished_requests()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_tokens_after_a_stop_are_dropped() -> None:
    sched = make_scheduler(include_finished_set=True)
    sched.add_request(make_request("a", 4))
    so = sched.schedule()
    mro = ModelRunnerOutput(["a"], {"a": 0}, sampled_token_ids=[[EOS, 9, 9]])
    eco = sched.update_from_output(so, mro)
    assert eco[0].outputs[0].new_token_ids == [EOS]
    assert eco[0].finished_requests == {"a"}


# --- aborts, outputs, stats --------------------------------------------------


def test_abort_frees_blocks() -> None:
    sched = make_scheduler(num_gpu_blocks=5, max_num_seqs=1)
    sched.add_request(make_request("run", 8))
    sched.add_request(make_request("wait", 8))
    step(sched)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 2
    aborted = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sorted(aborted) == [("run", 0), ("wait", 0)]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 4
    assert sched.running == [] and len(sched.waiting) == 0 and sched.requests == {}
    assert sched.finished_req_ids == {"run", "wait"}
    assert sched.has_requests() and not sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"run", "wait"} and so.total_num_scheduled_tokens == 0
    assert not sched.has_requests()
    # Aborting again is a no-op.
    assert sched.finish_requests("run", RequestStatus.FINISHED_ABORTED) == []


def test_outputs_events_and_stats() -> None:
    sched = make_scheduler(num_gpu_blocks=17, include_finished_set=True)
    a = make_request("a", list(range(10, 19)), max_tokens=2, logprobs=1)
    a.client_index = 1
    sched.add_request(a)
    so = sched.schedule()
    mro = runner_output(sched, so)
    mro.logprobs = LogprobsLists([[TOKEN, 3]], [[-0.1, -2.0]], [1])
    eco = sched.update_from_output(so, mro)
    assert set(eco) == {1}
    out = eco[1].outputs[0]
    assert out.new_token_ids == [TOKEN]
    assert out.prefill_stats is not None and out.prefill_stats.num_cached_tokens == 0
    assert out.new_logprobs == LogprobsLists([[TOKEN, 3]], [[-0.1, -2.0]], [1])
    assert out.events is not None
    assert [e.type for e in out.events] == [
        EngineCoreEventType.QUEUED,
        EngineCoreEventType.SCHEDULED,
    ]
    stats = eco[1].scheduler_stats
    assert stats is not None
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.step_counter) == (1, 0, 1)
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.num_cached_blocks) == (16, 13, 2)
    assert stats.kv_cache_usage == 3 / 16

    # A second request with the same prompt hits a's 2 full blocks.
    sched.add_request(make_request("b", list(range(10, 19)), max_tokens=1))
    so, eco = step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert so.scheduled_new_reqs[0].block_ids == ([1, 2, 4],)  # a holds 1, 2, 3
    assert set(eco) == {0, 1}
    b_out = eco[0].outputs[0]
    assert b_out.prefill_stats is not None and b_out.prefill_stats.num_cached_tokens == 8
    assert b_out.finish_reason == FinishReason.LENGTH
    assert eco[0].finished_requests == {"b"} and eco[1].finished_requests == {"a"}
    stats = eco[0].scheduler_stats or eco[1].scheduler_stats
    assert stats is not None and stats.prefix_cache_stats.hits == 8


def test_blocks_balance_under_load() -> None:
    """Many requests sharing prefixes, a tight pool, chunking and preemption:
    at every step free + held = usable, and at the end every block is free."""
    for caching in (True, False):
        sched = make_scheduler(
            num_gpu_blocks=8,
            max_num_batched_tokens=12,
            long_prefill_token_threshold=8,
            enable_prefix_caching=caching,
        )
        shared = [500 + i for i in range(8)]
        for i in range(8):
            prompt = shared[: 4 + (i % 3) * 2] + [600 + 10 * i + j for j in range(i % 5 + 1)]
            sched.add_request(make_request(f"r{i}", prompt, max_tokens=3 + i % 4))
        preemptions = 0
        for _ in range(200):
            if not sched.has_unfinished_requests():
                break
            so, _ = step(sched)
            assert so.total_num_scheduled_tokens <= 12
            preemptions += len(so.preempted_req_ids or ())
            check_blocks(sched)
        assert not sched.has_unfinished_requests()
        assert preemptions > 0
        pool = sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == 7
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def test_reset_prefix_cache() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 9))
    step(sched)
    assert not sched.reset_prefix_cache()
    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert sched.requests["a"].status == RequestStatus.PREEMPTED
    assert sched.kv_cache_manager.block_pool.num_cached_blocks == 0
