"""ModelRunner._update_states / _prepare_inputs on hand-built SchedulerOutputs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.parallel_utils import init_world_of_one
from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from tracevllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from tracevllm.sampling_params import SamplingParams
from tracevllm.worker.model_runner import ModelRunner

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


@pytest.fixture
def runner() -> ModelRunner:
    # No weights needed: these tests stop before the forward pass. A runner
    # lives in a worker, whose world (here of one) is up before it is made.
    init_world_of_one()
    vllm_config = VllmConfig(
        ModelConfig(model="unused", hf_config=dict(HF_CONFIG)),
        CacheConfig(block_size=4),
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
    )
    return ModelRunner(vllm_config)


def new_req(req_id: str, prompt: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, prompt, SamplingParams(temperature=0.0), (blocks,), computed)


def sched(
    new: list[NewRequestData],
    num_scheduled: dict[str, int],
    cached: CachedRequestData | None = None,
    finished: set[str] | None = None,
) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached or CachedRequestData(),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens={},
        num_common_prefix_blocks=[],
        finished_req_ids=finished or set(),
    )


def test_vllm_example_2_5_3(runner: ModelRunner) -> None:
    a, b, c = [10, 11], [20, 21, 22, 23, 24, 25, 26, 27], [30, 31, 32]
    so = sched(
        [new_req("a", a, [5]), new_req("b", b, [2, 9]), new_req("c", c, [7])],
        {"a": 2, "b": 5, "c": 3},  # b is a partial prefill: 5 of its 8 tokens
    )
    runner._update_states(so)
    _, logits_indices, discard = runner._prepare_inputs(so)

    assert runner.input_batch.req_ids == ["a", "b", "c"]
    np.testing.assert_array_equal(runner.req_indices, [0, 0, 1, 1, 1, 1, 1, 2, 2, 2])
    # Fresh requests: positions are the query positions [0,1,0,1,2,3,4,0,1,2].
    assert runner.positions.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
    assert runner.input_ids.tolist() == [10, 11, 20, 21, 22, 23, 24, 30, 31, 32]
    assert runner.query_start_loc.tolist() == [0, 2, 7, 10]
    assert runner.seq_lens.tolist() == [2, 5, 3]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert runner.slot_mapping.tolist() == [20, 21, 8, 9, 10, 11, 36, 28, 29, 30]
    assert logits_indices.tolist() == [1, 6, 9]
    # b's sample is thrown away: its chunk stops short of its 8 known tokens.
    assert discard.tolist() == [1]
    md = runner.attn_metadata
    assert md is not None and md.max_query_len == 5 and md.max_seq_len == 5
    assert md.block_table.tolist() == [[5, 0], [2, 9], [7, 0]]


def test_second_step_continues_chunk_and_drops_finished(runner: ModelRunner) -> None:
    a, b = list(range(40, 46)), list(range(50, 59))
    so = sched([new_req("a", a, [3, 4]), new_req("b", b, [1, 6])], {"a": 6, "b": 8})
    runner._update_states(so)
    runner._prepare_inputs(so)
    # Pretend a sampled token 99 in step 1 (what sample_tokens does).
    row = runner.input_batch.req_id_to_index["a"]
    runner.input_batch.token_ids_cpu[row, 6] = 99
    runner.input_batch.num_tokens_no_spec[row] = 7
    runner.requests["a"].output_token_ids.append(99)

    # Step 2: a decodes its sampled token; b finishes its prompt (1 token left),
    # and gets a new block; c arrives with 4 tokens already cached (prefix hit).
    cached = CachedRequestData(
        req_ids=["a", "b"],
        new_block_ids=[None, ([8],)],
        num_computed_tokens=[6, 8],
        num_output_tokens=[1, 0],
    )
    so2 = sched(
        [new_req("c", [7, 7, 7, 7, 8, 9], [2, 5], computed=4)], {"a": 1, "b": 1, "c": 2}, cached
    )
    runner._update_states(so2)
    _, logits_indices, discard = runner._prepare_inputs(so2)
    assert runner.input_batch.req_ids == ["a", "b", "c"]
    assert runner.positions.tolist() == [6, 8, 4, 5]
    assert runner.input_ids.tolist() == [99, 58, 8, 9]
    assert runner.seq_lens.tolist() == [7, 9, 6]
    # a: block 4 offset 2; b: pos 8 -> its new third block 8; c: block 5 offsets 0, 1
    assert runner.slot_mapping.tolist() == [18, 32, 20, 21]
    assert logits_indices.tolist() == [0, 1, 3]
    assert discard.tolist() == []

    # Step 3: a finished, b not scheduled (kept aside), c decodes: c moves to row 0.
    runner.input_batch.token_ids_cpu[2, 6] = 77
    runner.input_batch.num_tokens_no_spec[2] = 7
    runner.requests["c"].output_token_ids.append(77)
    cached3 = CachedRequestData(
        req_ids=["c"], new_block_ids=[None], num_computed_tokens=[6], num_output_tokens=[1]
    )
    so3 = sched([], {"c": 1}, cached3, finished={"a"})
    runner._update_states(so3)
    runner._prepare_inputs(so3)
    assert runner.input_batch.req_ids == ["c"]
    assert "a" not in runner.requests and "b" in runner.requests
    assert runner.input_ids.tolist() == [77]
    assert runner.slot_mapping.tolist() == [22]


def test_resumed_request_replaces_its_blocks(runner: ModelRunner) -> None:
    so = sched([new_req("a", [1, 2, 3, 4, 5], [3, 4])], {"a": 5})
    runner._update_states(so)
    runner._prepare_inputs(so)
    # Preempted: the next step does not schedule it (it leaves the batch).
    runner._update_states(sched([], {}))
    assert runner.input_batch.num_reqs == 0
    # Resumed with new blocks, recomputing from scratch.
    cached = CachedRequestData(
        req_ids=["a"],
        resumed_req_ids={"a"},
        new_block_ids=[([6, 1],)],
        num_computed_tokens=[0],
        num_output_tokens=[0],
    )
    so2 = sched([], {"a": 5}, cached)
    runner._update_states(so2)
    runner._prepare_inputs(so2)
    assert runner.requests["a"].block_ids == ([6, 1],)
    assert runner.slot_mapping.tolist() == [24, 25, 26, 27, 4]


def test_empty_step_returns_empty_output(runner: ModelRunner) -> None:
    from tracevllm.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    assert runner.execute_model(sched([], {})) is EMPTY_MODEL_RUNNER_OUTPUT
    assert runner.sample_tokens() is EMPTY_MODEL_RUNNER_OUTPUT
