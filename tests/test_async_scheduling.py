"""Async scheduling: the engine core schedules step N+1 while the workers run step N.

With ``async_scheduling=True`` (``AsyncScheduler``, a batch queue of two)
greedy tokens equal the synchronous path's, on the ``mp`` backend at T = 1
and T = 2 (the tiny Llama, 4 query / 2 KV heads) and on ``uni``, with
chunked prefill, prefix-cache hits and preemptions happening (asserted) and
a repetition penalty (which must see the real tokens, not placeholders).
Requests stop at exactly the sync path's token (max_tokens, stop tokens),
although a step more is in flight when a stop token comes, and every KV
block is back afterwards; no step is scheduled past max_tokens (the
``AsyncScheduler`` driven by hand, as the batch queue drives it); an abort
mid-generation leaves the other requests' tokens and the pool as they
should be; a JSON schema holds (its steps' sampling deferred until the token
in flight is in); a worker killed mid-generate is ``EngineDeadError``. The spans
show the overlap: with async on, a step's ``Scheduler.schedule`` starts
before the worker's forward of the step before it ends; with it off, no
``Scheduler.schedule`` starts during a forward.

The engine cores run in this process (the tests read their scheduler and KV
pool), but for the span test's (its own process, as served); the ``mp``
backend's workers run in their own processes. A killed worker is a scenario
in a child process (tests/async_scheduling_scenarios.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest

from tests.utils import run_json_lines
from tracevllm import LLM, SamplingParams
from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from tracevllm.core.sched.async_scheduler import AsyncScheduler
from tracevllm.engine import FinishReason
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.outputs import ModelRunnerOutput

pytestmark = pytest.mark.timeout(900)

# As tests/test_tensor_parallel.py: a shared 16-token block (prefix hits),
# prompts longer than the 32-token budget (chunked prefill), more KV than 10
# blocks hold once all decode (preemption).
PREFIX = "Continue the text below, in the same style, for as long as you can: "
PROMPTS = [
    PREFIX + "The capital of France is Paris. The capital of Germany is Berlin. The capital of",
    PREFIX + "A paged KV cache stores keys and values in blocks; a block table maps them.",
    PREFIX + "1 2 3 4 5 1 2 3 4 5 1 2 3",
    PREFIX + "The scheduler decides which requests run in each step, and which of them must wait.",
]
MAX_TOKENS = 24
ENGINE: dict[str, Any] = dict(
    enable_chunked_prefill=True,
    max_num_batched_tokens=32,
    enable_prefix_caching=True,
    num_gpu_blocks_override=10,
    max_model_len=160,
)
# backend, T
ASYNC_ENGINES = {"mp-T1": ("mp", 1), "mp-T2": ("mp", 2), "uni": ("uni", 1)}


def _params() -> list[SamplingParams]:
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # The last one's penalty counts its earlier tokens: with async scheduling
    # the latest of them is a placeholder on the worker until it is filled in.
    return [SamplingParams(**greedy) for _ in PROMPTS[:-1]] + [
        SamplingParams(**greedy, repetition_penalty=1.5)
    ]


def _llm(tiny_model_dir: str, backend: str, tp: int, async_scheduling: bool | None) -> LLM:
    return LLM(
        model=tiny_model_dir,
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        enable_multiprocessing=False,
        async_scheduling=async_scheduling,
        **ENGINE,
    )


def _core(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _run(llm: LLM, prompts: list[str], params: Any) -> tuple[list[Any], int]:
    before = llm.llm_engine.num_preemptions
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.llm_engine.num_preemptions - before


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _assert_pool_free(llm: LLM) -> None:
    core = _core(llm)
    assert not core.scheduler.has_unfinished_requests()
    assert core.get_kv_cache_stats()["used"] == 0, core.get_kv_cache_stats()


@pytest.fixture(scope="module")
def sync_llm(tiny_model_dir: str) -> Iterator[LLM]:
    """The reference: the synchronous path (None resolves to off)."""
    with _llm(tiny_model_dir, "uni", 1, None) as llm:
        assert type(_core(llm).scheduler) is not AsyncScheduler
        assert _core(llm).batch_queue is None
        yield llm


@pytest.fixture(scope="module")
def sync_greedy(sync_llm: LLM) -> tuple[list[Any], int]:
    return _run(sync_llm, PROMPTS, _params())


@pytest.fixture(scope="module", params=list(ASYNC_ENGINES))
def async_llm(request: pytest.FixtureRequest, tiny_model_dir: str) -> Iterator[LLM]:
    backend, tp = ASYNC_ENGINES[request.param]
    with _llm(tiny_model_dir, backend, tp, True) as llm:
        core = _core(llm)
        assert isinstance(core.scheduler, AsyncScheduler)
        assert core.batch_queue_size == 2  # vLLM's: one running, one scheduled
        yield llm


# --- config --------------------------------------------------------------------------


def _config(tiny_model_dir: str, **kw: Any) -> Any:
    return EngineArgs(model=tiny_model_dir, max_model_len=160, **kw).create_engine_config()


def test_none_is_off_and_true_picks_the_async_scheduler(tiny_model_dir: str) -> None:
    config = _config(tiny_model_dir)
    assert config.scheduler_config.async_scheduling is False  # tracevllm's default
    assert config.scheduler_config.get_scheduler_cls().__name__ == "Scheduler"
    for backend in ("mp", "uni"):
        config = _config(
            tiny_model_dir, async_scheduling=True, distributed_executor_backend=backend
        )
        assert config.scheduler_config.get_scheduler_cls() is AsyncScheduler


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        # vLLM's errors, in its words.
        (
            dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
            ValueError,
            "Currently, async scheduling is only supported with EAGLE/MTP/Draft Model/NGram "
            "GPU kind of speculative decoding",
        ),
        (
            dict(distributed_executor_backend="ray"),
            ValueError,
            "`ray` does not support async scheduling yet.",
        ),
        # tracevllm's: what vLLM runs with async scheduling and tracevllm does not.
        (dict(pipeline_parallel_size=2), NotImplementedError, "drop --async-scheduling"),
        (dict(async_scheduling="yes"), TypeError, "async_scheduling must be True, False or None"),
        (dict(async_scheduling=1), TypeError, "got int"),
    ],
    ids=["ngram", "ray", "pp", "str", "int"],
)
def test_what_async_scheduling_refuses(
    tiny_model_dir: str, kw: dict[str, Any], error: type[Exception], message: str
) -> None:
    kw = {"async_scheduling": True, **kw}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(tiny_model_dir, **kw)


def test_a_draft_model_is_refused_naming_the_flag(tiny_model_dir: str) -> None:
    spec = {"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": 2}
    with pytest.raises(NotImplementedError, match="drop --async-scheduling"):
        _config(tiny_model_dir, async_scheduling=True, speculative_config=spec)
    # Without the flag, the draft model runs on the sync path.
    assert (
        _config(tiny_model_dir, speculative_config=spec).scheduler_config.async_scheduling is False
    )


def test_cli_flags_are_vllms() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args([]).async_scheduling is None
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False


# --- tokens -----------------------------------------------------------------------------


def test_greedy_tokens_equal_the_sync_path_with_chunks_prefix_hits_and_preemption(
    async_llm: LLM, sync_greedy: tuple[list[Any], int], tokenizer: Any
) -> None:
    want, want_preempted = sync_greedy
    # The runs are cut up as claimed: chunks, prefix hits, preemptions.
    assert all(len(tokenizer.encode(p)) > ENGINE["max_num_batched_tokens"] for p in PROMPTS)
    assert want_preempted > 0 and any(o.num_cached_tokens > 0 for o in want)
    got, preempted = _run(async_llm, PROMPTS, _params())
    assert preempted > 0  # the placeholders' slots are taken a step earlier: not always as many
    assert any(o.num_cached_tokens > 0 for o in got)
    assert _tokens(got) == _tokens(want)
    _assert_pool_free(async_llm)


def _stop_params(reference: list[list[int]]) -> list[SamplingParams]:
    """max_tokens 1 and 2; a stop token taken from the middle of the sync output
    and one that is the very first token (its first occurrence ends the request)."""
    base = dict(temperature=0.0, max_tokens=MAX_TOKENS)
    return [
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        SamplingParams(**base, stop_token_ids=[reference[2][6]]),
        SamplingParams(**base, stop_token_ids=[reference[3][0]]),
    ]


def test_stops_end_at_the_sync_paths_token_and_free_every_block(
    async_llm: LLM, sync_llm: LLM, sync_greedy: tuple[list[Any], int]
) -> None:
    params = _stop_params(_tokens(sync_greedy[0]))
    want, _ = _run(sync_llm, PROMPTS, params)
    got, _ = _run(async_llm, PROMPTS, params)
    assert [len(t) for t in _tokens(want)][:2] == [1, 2]
    assert [o.outputs[0].finish_reason for o in want] == ["length", "length", "stop", "stop"]
    assert _tokens(got) == _tokens(want)
    assert [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in got] == [
        (o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in want
    ]
    # The step in flight when the stop token came ran on: its token is dropped
    # and the request's blocks were freed all the same.
    _assert_pool_free(async_llm)


def _async_scheduler(num_gpu_blocks: int = 16) -> AsyncScheduler:
    from tests.test_scheduler import BS

    model_config = ModelConfig(
        model="fake",
        hf_config={"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096},
        max_model_len=64,
    )
    cache_config = CacheConfig(block_size=BS)
    cache_config.num_gpu_blocks = num_gpu_blocks
    scheduler_config = SchedulerConfig(max_model_len=64, async_scheduling=True)
    config = VllmConfig(model_config, cache_config, scheduler_config)
    scheduler_cls = config.scheduler_config.get_scheduler_cls()
    assert scheduler_cls is AsyncScheduler
    return AsyncScheduler(config)


def _sampled(so: Any, token: int) -> ModelRunnerOutput:
    """The runner's answer to step ``so``: ``token`` for every request in it."""
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
    )


def test_the_async_scheduler_runs_a_step_ahead_but_never_past_max_tokens() -> None:
    from tests.test_scheduler import TOKEN, make_request, outputs_of

    sched = _async_scheduler()
    req = make_request("r", 6, max_tokens=3)
    sched.add_request(req)
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"r": 6} and req.num_output_placeholders == 1
    # Before step 1's token is known, the next step runs it (a placeholder).
    so2 = sched.schedule()
    assert so2.num_scheduled_tokens == {"r": 1} and req.num_output_placeholders == 2
    assert (req.num_computed_tokens, req.num_tokens) == (7, 6)
    assert outputs_of(sched.update_from_output(so1, _sampled(so1, TOKEN))) == {"r": [TOKEN]}
    assert req.num_output_placeholders == 1 and req.num_tokens == 7
    # As the engine's batch queue of two does: schedule one, take the oldest's output.
    so3 = sched.schedule()
    assert so3.num_scheduled_tokens == {"r": 1} and req.num_output_placeholders == 2
    assert outputs_of(sched.update_from_output(so2, _sampled(so2, TOKEN))) == {"r": [TOKEN]}
    # Two tokens known, the third (the last) in flight: a step now would be past max_tokens.
    so4 = sched.schedule()
    assert so4.num_scheduled_tokens == {} and req.num_output_placeholders == 1
    eco = sched.update_from_output(so3, _sampled(so3, TOKEN))
    assert outputs_of(eco) == {"r": [TOKEN]} and req.get_finished_reason() == FinishReason.LENGTH
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 15


def test_a_stop_token_drops_the_step_in_flight_and_frees_the_blocks() -> None:
    from tests.test_scheduler import EOS, TOKEN, make_request, outputs_of

    sched = _async_scheduler()
    req = make_request("r", 6, max_tokens=10)
    sched.add_request(req)
    so1, so2 = sched.schedule(), sched.schedule()
    assert so2.num_scheduled_tokens == {"r": 1}
    eco = sched.update_from_output(so1, _sampled(so1, EOS))
    assert outputs_of(eco) == {"r": [EOS]} and req.get_finished_reason() == FinishReason.STOP
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 15  # freed at once
    # The step that ran on the EOS answers after: its token goes nowhere.
    assert outputs_of(sched.update_from_output(so2, _sampled(so2, TOKEN))) == {}
    assert not sched.has_unfinished_requests()


def test_abort_mid_generation(async_llm: LLM, sync_greedy: tuple[list[Any], int]) -> None:
    want = _tokens(sync_greedy[0])
    engine = async_llm.llm_engine
    params = _params()
    for i in range(3):
        engine.add_request(f"abort-{i}", PROMPTS[i], params[i])
    got: dict[str, list[int]] = {f"abort-{i}": [] for i in range(3)}
    aborted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
        # Once request 0 has tokens (its next step is already in flight), abort it.
        if not aborted and got["abort-0"]:
            engine.abort_request(["abort-0"])
            aborted = True
    assert aborted and 0 < len(got["abort-0"]) < MAX_TOKENS
    assert got["abort-0"] == want[0][: len(got["abort-0"])]
    assert [got["abort-1"], got["abort-2"]] == want[1:3]
    _assert_pool_free(async_llm)


def test_a_json_schema_holds_with_sampling_deferred(
    async_llm: LLM, sync_llm: LLM, tokenizer: Any
) -> None:
    """A structured request's bitmask needs its token in flight: each of its
    decode steps samples only after the step before is in (deferred)."""
    import json

    import jsonschema

    from tests.test_tensor_parallel import ANSWER_SCHEMA
    from tracevllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=ANSWER_SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    want, _ = _run(sync_llm, PROMPTS[:2], params)
    got, _ = _run(async_llm, PROMPTS[:2], params)
    assert _tokens(got) == _tokens(want)
    for g in got:
        assert g.outputs[0].finish_reason == "stop", g.outputs[0]
        jsonschema.validate(json.loads(g.outputs[0].text), ANSWER_SCHEMA)
    _assert_pool_free(async_llm)


# --- processes and spans ------------------------------------------------------------------


def test_a_killed_worker_is_engine_dead_and_nothing_is_left(tiny_model_dir: str) -> None:
    (out,) = run_json_lines(
        "tests.async_scheduling_scenarios", "kill_rank", tiny_model_dir, "1", "0", timeout=180
    )
    assert out["error"] is not None, out
    assert f"VllmWorker-0 (rank 0, pid {out['victim']}) exited with signal 9" in out["error"], out
    assert out["waited"] < 10, out
    assert out["left"] == [] and out["shm"] == [] and not out["socket_dir"], out


def _overlaps(spans: list[Any]) -> list[tuple[int, int]]:
    """(N, N + 1) for each pair of steps that run the model where step N + 1's
    ``Scheduler.schedule`` starts before the worker's forward of step N ends.

    A step's worker spans and its ``Scheduler.schedule`` are children of the
    engine core's step span that scheduled it: that span's step id names them.
    """
    from tracevllm.tracing.attributes import SpanAttributes

    by_id = {s.span_id: s for s in spans}

    def step_of(span: Any) -> int | None:
        parent = by_id.get(span.parent_span_id)
        if parent is None or parent.process_kind != "engine_core":
            return None
        return parent.attributes.get(SpanAttributes.STEP_ID)

    forwards = {
        step_of(s): s
        for s in spans
        if s.name == "ModelRunner.execute_model" and s.process_kind == "worker"
    }
    # Steps that ran the model (an empty step's forward prepares no inputs).
    model_steps = {
        step_of(by_id[s.parent_span_id])
        for s in spans
        if s.name == "ModelRunner._prepare_inputs" and s.parent_span_id in by_id
    }
    found = []
    for s in spans:
        step = step_of(s)
        if s.name != "Scheduler.schedule" or step is None:
            continue
        both_ran = step in model_steps and step - 1 in model_steps and step - 1 in forwards
        # (The worker may not even have started step N: it still samples N - 1.)
        if both_ran and s.start_ns < forwards[step - 1].end_ns:
            found.append((step - 1, step))
    return found


# The step whose output a batch-queue step took (records.step_with_batch_queue).
OUTPUT_STEP_ID = "tracevllm.batch_queue.output_step_id"


@pytest.mark.parametrize("mode", ["on", "off"])
def test_spans_show_the_next_step_scheduled_during_the_forward(
    tiny_model_dir: str, tmp_path: Any, mode: str
) -> None:
    from tests.executor_scenarios import make_llm
    from tracevllm.tracing.attributes import SpanAttributes
    from tracevllm.tracing.exporters import read_spans_jsonl

    # EngineCore in its own process, its worker in another (the mp backend);
    # this process is the frontend (a child's would import torch once more).
    llm = make_llm(
        tiny_model_dir,
        1,
        async_scheduling=mode == "on",
        trace_detail="request",
        trace_dir=str(tmp_path),
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        [out] = llm.generate(["The capital of France"], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(out.outputs[0].token_ids) == 12
    spans = read_spans_jsonl(str(tmp_path / "spans.jsonl"))
    by_id = {s.span_id: s for s in spans}
    step_name = "EngineCore.step_with_batch_queue" if mode == "on" else "EngineCore.step"
    forwards = [s for s in spans if s.name == "ModelRunner.execute_model"]
    assert forwards
    for span in forwards:
        # The worker's spans join the trace of the step that sent them.
        parent = by_id[span.parent_span_id]
        assert parent.name == step_name and parent.process_kind == "engine_core"
        assert parent.trace_id == span.trace_id and parent.pid != span.pid
    if mode == "on":
        # One request, 12 tokens: its 11 decodes are each scheduled a step
        # ahead, before the engine takes the step before's output (which the
        # step's span names): the mechanism, whatever the machine's load.
        # Whether the worker's forward is still running at that moment is up
        # to the OS's scheduler (on a loaded machine it often is not), so the
        # timed overlaps are only shown.
        ahead = [
            (s.attributes[SpanAttributes.STEP_ID], s.attributes[OUTPUT_STEP_ID])
            for s in spans
            if s.name == step_name
            and s.attributes.get(OUTPUT_STEP_ID, -1) >= 0
            and s.attributes[OUTPUT_STEP_ID] == s.attributes[SpanAttributes.STEP_ID] - 1
        ]
        assert len(ahead) >= 8, (ahead, _overlaps(spans))
    else:
        schedules = [s for s in spans if s.name == "Scheduler.schedule"]
        assert schedules
        assert not [
            (f.name, s.name)
            for s in schedules
            for f in forwards
            if f.start_ns < s.start_ns < f.end_ns
        ]
