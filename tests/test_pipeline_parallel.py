"""Pipeline parallelism and EngineCore's batch queue, on a tiny 4-layer Llama.

The engines run one after another in one child process (``python -m
tests.test_pipeline_parallel run_several ...``) under a timeout, with the ``mp``
executor's real worker processes, each printing one JSON line: a crash or a
hang fails the tests instead of pytest.
The engines run the family check's workload (tests/family_check.py): 8
prompts x 32 greedy tokens, pages of 4 tokens, 16-token chunked prefill, a
shared prefix that must hit the cache and a pool small enough that requests
are preempted. Checked: P = 2 and T x P = 2 x 2 give HF's tokens and
log-probabilities (and so P = 1's); each stage's KV cache holds its own layers
only (asked from every rank through ``collective_rpc``); with the batch queue
two steps are in flight at once (EngineCore's count, and the workers' spans:
the first stage starts a step before the last stage has sampled the one
before), and without it (an executor whose ``max_concurrent_batches`` is 1)
the tokens are the same and no step ever overlaps the next.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

import pytest
import torch

from tests.family_check import (
    BLOCK_SIZE,
    NUM_TOKENS,
    hf_greedy,
    make_prompts,
    new_checkpoint_dir,
    save_hf_model,
    tiny_config_kwargs,
)
from tests.utils import run_json_lines
from tracevllm.executor.multiproc_executor import MultiprocExecutor

# The module's engines run in one child process, one after another (the
# ``runs`` fixture): minutes on a loaded machine, for the first test that asks.
pytestmark = pytest.mark.timeout(1800)

NUM_LAYERS = 4
STRUCTURED_REGEX = "[0-9]{3}-[a-z]{2}"
NUM_KV_HEADS = 2


class NoBatchQueueMultiprocExecutor(MultiprocExecutor):
    """The ``mp`` executor with one batch at a time: EngineCore then steps
    synchronously (``step``), the pipeline stages taking turns."""

    @property
    def max_concurrent_batches(self) -> int:
        return 1


# --- run on every rank through collective_rpc (called as f(worker)) -----------------
def kv_cache_layers(worker: Any) -> dict[str, Any]:
    """This rank's place, the decoder layers its KV cache tensors are for, and their size."""
    from tracevllm.distributed.parallel_state import get_pp_group, get_tp_group

    runner = worker.model_runner
    config = runner.kv_cache_config
    names = [name for tensor in config.kv_cache_tensors for name in tensor.shared_by]
    return {
        "rank": worker.rank,
        "pp_rank": get_pp_group().rank_in_group,
        "tp_rank": get_tp_group().rank_in_group,
        "layers": sorted(int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in names),  # type: ignore[union-attr]
        "bound": sorted(
            int(re.search(r"layers\.(\d+)\.", n).group(1))  # type: ignore[union-attr]
            for n, layer in runner.attn_layers.items()
            if layer.kv_cache.numel() > 0
        ),
        "numel": sum(c.numel() for c in runner.kv_caches),
        "num_blocks": config.num_blocks,
    }


# --- the child process ------------------------------------------------------------
def run_pp(
    model: str, tp: str, pp: str, batch_queue: str, trace_dir: str, mode: str = "inproc"
) -> None:
    """Generate the family check's workload at T x P; print what the test checks.

    ``mode`` "proc": EngineCore in its own process (EngineCoreProc's busy
    loop), which this process cannot look into: tokens and counts only."""
    from tests.test_pipeline_parallel import NoBatchQueueMultiprocExecutor as NoQueue
    from tracevllm import LLM, SamplingParams

    world = int(tp) * int(pp)
    backend: Any = None
    if world > 1:
        backend = "mp" if batch_queue == "1" else NoQueue
    kwargs: dict[str, Any] = {}
    if trace_dir != "-":
        kwargs = dict(trace_detail="request", trace_dir=trace_dir)
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model).vocab_size
    prompts = make_prompts(vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    llm = LLM(
        model=model,
        tensor_parallel_size=int(tp),
        pipeline_parallel_size=int(pp),
        distributed_executor_backend=backend,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,  # chunked prefill; several steps' worth of work
        max_num_seqs=8,
        enable_prefix_caching=True,
        num_gpu_blocks_override=40,  # small: requests get preempted
        max_model_len=128,
        # In this process, so the engine core is reachable.
        enable_multiprocessing=mode == "proc",
        **kwargs,
    )
    try:
        core: Any = None
        kv = None
        if mode != "proc":
            core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
            kv = core.model_executor.collective_rpc(kv_cache_layers)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "logprobs": [
                [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outputs
            ],
            "num_cached_tokens": [o.num_cached_tokens for o in outputs],
            "num_preemptions": llm.llm_engine.num_preemptions,
            "batch_queue_size": core and core.batch_queue_size,
            "max_batches_in_flight": core and core.max_batches_in_flight,
            "kv": kv,
        }
        if core is not None and core.batch_queue is not None:
            result["abort"] = abort_in_flight(llm, core, prompts, params)
        if mode == "proc":
            # A structured request: the last stage masks with the grammar's bitmask.
            from tracevllm.sampling_params import StructuredOutputsParams

            structured = SamplingParams(
                temperature=0.0,
                max_tokens=24,
                structured_outputs=StructuredOutputsParams(regex=STRUCTURED_REGEX),
            )
            out = llm.generate(["Write a code:"] * 2, structured, use_tqdm=False)
            result["structured"] = [o.outputs[0].text for o in out]
    finally:
        llm.shutdown()
    print(json.dumps(result), flush=True)


def abort_in_flight(llm: Any, core: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """Abort a request while a step that runs it is in flight: its answer is
    dropped, the other request goes on, and every KV block comes back."""
    engine = llm.llm_engine
    a_id = engine.add_request("a", {"prompt_token_ids": prompts[3]}, params)  # 2 chunks
    engine.add_request("b", {"prompt_token_ids": prompts[2]}, params)
    outputs: dict[str, list[Any]] = {"a": [], "b": []}
    in_flight = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
        if not in_flight and any(a_id in so.num_scheduled_tokens for _, so, _ in core.batch_queue):
            in_flight = True
            engine.abort_request(["a"])
    a_tokens = outputs["a"][-1].outputs[0].token_ids if outputs["a"] else []
    return {
        "in_flight": in_flight,
        "a_tokens": len(a_tokens),
        "b_tokens": list(outputs["b"][-1].outputs[0].token_ids),
        "kv_used": core.get_kv_cache_stats()["used"],
    }


def run_several(model: str, *runs: str) -> None:
    """``run_pp`` for each run, one after another in this process: each run
    is ``TP,PP,BATCH_QUEUE,TRACE_DIR,MODE``. One Python process for all of
    them, so torch and the model's code are imported once."""
    for run in runs:
        run_pp(model, *run.split(","))


# (T, P, batch queue, trace directory or "-", mode): each engine the tests read.
RUNS = {
    "pp1": ("1", "1", "1", "-", "inproc"),
    "pp2_queue": ("1", "2", "1", "{queue_dir}", "inproc"),
    "pp2_no_queue": ("1", "2", "0", "{sync_dir}", "inproc"),
    "tp2_pp2": ("2", "2", "1", "-", "inproc"),
    "pp2_proc": ("1", "2", "1", "-", "proc"),
}


# --- the tests --------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """HF's tiny Llama with 4 layers (2 per stage at P = 2), and HF's greedy answers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-llama-4-layers")
    torch.manual_seed(0)
    config = LlamaConfig(**tiny_config_kwargs(vocab_size, num_hidden_layers=NUM_LAYERS))
    model = LlamaForCausalLM(config).eval()
    save_hf_model(model, path)
    return path, [hf_greedy(model, p, NUM_TOKENS) for p in make_prompts(vocab_size)]


@pytest.fixture(scope="module")
def runs(llama4: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every engine of this module, in one child process (under a timeout):
    name -> what ``run_pp`` printed; the two P = 2 traces' directories."""
    dirs = {
        "queue_dir": str(tmp_path_factory.mktemp("pp2-batch-queue")),
        "sync_dir": str(tmp_path_factory.mktemp("pp2-no-batch-queue")),
    }
    specs = [",".join(arg.format(**dirs) for arg in run) for run in RUNS.values()]
    lines = run_json_lines(
        "tests.test_pipeline_parallel", "run_several", llama4[0], *specs, timeout=1500
    )
    assert len(lines) == len(RUNS), lines
    return {**dict(zip(RUNS, lines, strict=True)), **dirs}


@pytest.fixture(scope="module")
def pp1(runs: dict[str, Any]) -> dict[str, Any]:
    return runs["pp1"]


def _check_hf(out: dict[str, Any], hf: list[tuple[list[int], list[float]]]) -> None:
    for i, (tokens, logprobs) in enumerate(hf):
        assert out["tokens"][i] == tokens, f"prompt {i}"
        torch.testing.assert_close(
            torch.tensor(out["logprobs"][i]), torch.tensor(logprobs), atol=1e-4, rtol=0
        )
    assert out["num_cached_tokens"][7] >= 16, "the shared prefix was not a cache hit"
    assert out["num_preemptions"] > 0, "no request was preempted"


def _check_kv(out: dict[str, Any], pp1: dict[str, Any], tp: int, pp: int) -> None:
    """Stage s holds layers [s * L/P, (s + 1) * L/P) and 1/(T x P) of P = 1's KV cache."""
    ((whole,),) = [pp1["kv"]]
    assert whole["layers"] == list(range(NUM_LAYERS))
    per_stage = NUM_LAYERS // pp
    assert len(out["kv"]) == tp * pp
    for rank, kv in enumerate(out["kv"]):
        assert kv["rank"] == rank and (kv["pp_rank"], kv["tp_rank"]) == divmod(rank, tp)
        mine = list(range(kv["pp_rank"] * per_stage, (kv["pp_rank"] + 1) * per_stage))
        assert kv["layers"] == mine and kv["bound"] == mine, kv
        assert kv["num_blocks"] == whole["num_blocks"]
        assert kv["numel"] * tp * pp == whole["numel"], kv


def test_pp1_matches_hf(llama4: tuple[str, Any], pp1: dict[str, Any]) -> None:
    _check_hf(pp1, llama4[1])
    assert pp1["batch_queue_size"] == 1 and pp1["max_batches_in_flight"] == 0


def _stage_spans(trace_dir: str) -> dict[tuple[int, str], list[Any]]:
    """(pp rank, method) -> the TP rank 0 worker's runner spans, in call order."""
    from tracevllm.tracing.exporters import read_spans_jsonl

    spans = read_spans_jsonl(os.path.join(trace_dir, "spans.jsonl"))
    by: dict[tuple[int, str], list[Any]] = {}
    for s in spans:
        runner_span = s.name in ("ModelRunner.execute_model", "ModelRunner.sample_tokens")
        if runner_span and s.resource["tracevllm.tp_rank"] == 0:
            by.setdefault((s.resource["tracevllm.pp_rank"], s.name), []).append(s)
    return by


def _steps_overlapping(trace_dir: str) -> int:
    """Steps k for which the first stage began step k + 1 before the last stage
    had sampled step k: both were in flight at once. Every rank gets every
    execute_model call, in order, so the k-th such span on each rank is step
    k's; a step's sample_tokens (none for an empty step) follows its own."""
    by = _stage_spans(trace_dir)
    first_exec = by[(0, "ModelRunner.execute_model")]
    last_exec = by[(1, "ModelRunner.execute_model")]
    assert len(first_exec) == len(last_exec) > 10
    samples = iter(by[(1, "ModelRunner.sample_tokens")])
    sample = next(samples, None)
    overlapping = 0
    for k in range(len(last_exec) - 1):
        if sample is None or sample.start_ns >= last_exec[k + 1].start_ns:
            continue  # step k sampled nothing
        assert sample.start_ns >= last_exec[k].end_ns
        overlapping += first_exec[k + 1].start_ns < sample.end_ns
        sample = next(samples, None)
    return overlapping


@pytest.fixture(scope="module")
def pp2_runs(runs: dict[str, Any]) -> Any:
    return runs["pp2_queue"], runs["queue_dir"], runs["pp2_no_queue"], runs["sync_dir"]


def test_pp2_matches_hf_and_each_stage_holds_its_layers(
    llama4: tuple[str, Any], pp1: dict[str, Any], pp2_runs: Any
) -> None:
    with_queue, _, without, _ = pp2_runs
    for out in (with_queue, without):
        _check_hf(out, llama4[1])
        assert out["tokens"] == pp1["tokens"]
        _check_kv(out, pp1, tp=1, pp=2)


def test_a_request_aborted_in_flight_gets_nothing_more(
    llama4: tuple[str, Any], pp2_runs: Any
) -> None:
    abort = pp2_runs[0]["abort"]
    assert abort["in_flight"], abort
    assert abort["a_tokens"] < NUM_TOKENS, abort
    assert abort["b_tokens"] == llama4[1][2][0]
    assert abort["kv_used"] == 0


def test_the_batch_queue_keeps_two_steps_in_flight(pp2_runs: Any) -> None:
    with_queue, queue_dir, without, sync_dir = pp2_runs
    # EngineCore's count: two steps with work sent before the first answered.
    assert with_queue["batch_queue_size"] == 2
    assert with_queue["max_batches_in_flight"] == 2
    # The workers' own clocks: stage 0 ran ahead of stage 1 ...
    assert _steps_overlapping(queue_dir) > 10
    # ... which the synchronous step never lets happen, on the same tokens.
    assert without["batch_queue_size"] == 1 and without["max_batches_in_flight"] == 0
    assert _steps_overlapping(sync_dir) == 0
    assert with_queue["tokens"] == without["tokens"]
    # EngineCore's span for each turn, the workers' spans below it.
    from tracevllm.tracing.exporters import read_spans_jsonl

    spans = read_spans_jsonl(os.path.join(queue_dir, "spans.jsonl"))
    by_id = {s.span_id: s for s in spans}
    turns = [s for s in spans if s.name == "EngineCore.step_with_batch_queue"]
    full = [t for t in turns if t.attributes["tracevllm.batch_queue.in_flight"] == 2]
    assert full, "no turn had two steps in flight"
    for turn in full:  # it scheduled one step and answered the one before
        answered = turn.attributes["tracevllm.batch_queue.output_step_id"]
        assert 0 < answered < turn.attributes["tracevllm.step_id"]
    runs = [s for s in spans if s.name == "ModelRunner.execute_model"]
    assert {by_id[s.parent_span_id].name for s in runs} == {"EngineCore.step_with_batch_queue"}
    sync_spans = read_spans_jsonl(os.path.join(sync_dir, "spans.jsonl"))
    assert not [s for s in sync_spans if s.name == "EngineCore.step_with_batch_queue"]
    assert [s for s in sync_spans if s.name == "EngineCore.step"]


def test_tp2_pp2_matches_hf_and_each_rank_holds_a_quarter(
    llama4: tuple[str, Any], pp1: dict[str, Any], runs: dict[str, Any]
) -> None:
    out = runs["tp2_pp2"]
    _check_hf(out, llama4[1])
    assert out["tokens"] == pp1["tokens"]
    _check_kv(out, pp1, tp=2, pp=2)
    assert out["max_batches_in_flight"] == 2


def test_pp2_in_the_engine_core_process(
    llama4: tuple[str, Any], pp1: dict[str, Any], runs: dict[str, Any]
) -> None:
    """EngineCoreProc's busy loop steps while steps are in flight (has_work),
    and structured outputs hold at P = 2."""
    out = runs["pp2_proc"]
    _check_hf(out, llama4[1])
    assert out["tokens"] == pp1["tokens"]
    for text in out["structured"]:
        assert re.fullmatch(STRUCTURED_REGEX, text), text


def test_pp_is_refused_where_vllm_refuses_it(tiny_model_dir: str) -> None:
    from tracevllm.engine.arg_utils import EngineArgs

    with pytest.raises(NotImplementedError, match="Pipeline Parallelism without Ray"):
        EngineArgs(
            model=tiny_model_dir,
            pipeline_parallel_size=2,
            distributed_executor_backend="tracevllm.executor.uniproc_executor.UniProcExecutor",
        ).create_engine_config()
    with pytest.raises(NotImplementedError, match="Speculative decoding is not supported"):
        EngineArgs(
            model=tiny_model_dir,
            pipeline_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        ).create_engine_config()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
