"""Tensor parallelism end to end: real worker processes, real gloo collectives.

Greedy tokens at T = 3 on the default model (9 query / 3 KV heads) equal
T = 1's and HF transformers'; T = 2 and T = 4 on the tiny Llama (4 query / 2
KV heads: at 4 each KV head is held by two ranks) equal T = 1's, with chunked
prefill, prefix-cache hits and preemptions happening (asserted). What each
rank holds is measured on the rank (``collective_rpc`` with ``rank_shards``):
the weights its layers multiply by, checked against the slice of the HF
checkpoint that rank should hold, and its KV cache tensors. N-gram
speculative decoding at T = 2 and a JSON schema at T = 2 and 4 give T = 1's
output. At detail "full" every all-reduce and all-gather is a span with its
bytes and milliseconds, in every worker, under the step's trace (and in the
ranks view); below "full" there is none, and with tracing off no span is
even asked for.

One engine per configuration, shared by the tests (module fixtures); the
engine cores run in this process (so the tests reach the executor), their
workers in their own processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.reference import assert_lossless, hf_greedy
from tests.tp_probes import rank_shards, sleep_then
from tracevllm import LLM, SamplingParams
from tracevllm.executor.multiproc_executor import MultiprocExecutor
from tracevllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.timeout(900)

# A 16-token block shared by every prompt (prefix-cache hits), prompts longer
# than the 32-token step budget (chunked prefill), and more KV than 10 blocks
# hold once they all decode (preemption).
PREFIX = "Continue the text below, in the same style, for as long as you can: "
TINY_PROMPTS = [
    PREFIX + "The capital of France is Paris. The capital of Germany is Berlin. The capital of",
    PREFIX + "A paged KV cache stores keys and values in blocks; a block table maps them.",
    PREFIX + "1 2 3 4 5 1 2 3 4 5 1 2 3",
    PREFIX + "The scheduler decides which requests run in each step, and which of them must wait.",
]
TINY_TOKENS = 24
TINY_ENGINE: dict[str, Any] = dict(
    enable_chunked_prefill=True,
    max_num_batched_tokens=32,
    enable_prefix_caching=True,
    num_gpu_blocks_override=10,
    max_model_len=160,
)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _llm(model: str, tp: int, **kw: Any) -> LLM:
    # The engine core here, so the tests reach its executor; T > 1 is the mp
    # executor, one worker process per rank.
    return LLM(model=model, tensor_parallel_size=tp, enable_multiprocessing=False, **kw)


def _executor(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor


# --- what a rank holds: measured there (tests/tp_probes.py), expected here -------------


def _expected_shards(
    checkpoint: dict[str, torch.Tensor], config: Any, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """The slice of each HF tensor that TP rank ``rank`` of ``tp`` should hold,
    under tracevllm's (vLLM's) names: q/k/v stacked into qkv_proj (a KV head
    held by ``tp // num_kv_heads`` ranks when there are fewer than ``tp``),
    gate/up into gate_up_proj, the vocabulary padded to 64 rows and cut."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q_per, kv_per = heads // tp, max(1, kv_heads // tp)
    kv_start = (rank // max(1, tp // kv_heads)) * kv_per
    inter = config.intermediate_size // tp

    def rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
        return t[start : start + n]

    out: dict[str, torch.Tensor] = {}
    for name, t in checkpoint.items():
        prefix, _, _ = name.rpartition(".")
        if name.endswith("q_proj.weight"):
            base = prefix.rsplit(".", 1)[0]
            q = rows(t, rank * q_per * head_dim, q_per * head_dim)
            k = rows(checkpoint[f"{base}.k_proj.weight"], kv_start * head_dim, kv_per * head_dim)
            v = rows(checkpoint[f"{base}.v_proj.weight"], kv_start * head_dim, kv_per * head_dim)
            out[f"{base}.qkv_proj.weight"] = torch.cat([q, k, v])
        elif name.endswith("gate_proj.weight"):
            base = prefix.rsplit(".", 1)[0]
            up = checkpoint[f"{base}.up_proj.weight"]
            out[f"{base}.gate_up_proj.weight"] = torch.cat(
                [rows(t, rank * inter, inter), rows(up, rank * inter, inter)]
            )
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            cols = t.shape[1] // tp
            out[name] = t[:, rank * cols : (rank + 1) * cols]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            padded = -(-t.shape[0] // 64) * 64
            per = padded // tp
            full = torch.cat([t, t.new_zeros(padded - t.shape[0], t.shape[1])])
            out[name] = rows(full, rank * per, per)
        elif name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue  # stacked with q_proj / gate_proj above
        else:
            out[name] = t  # the norms: every rank holds them whole
    if getattr(config, "tie_word_embeddings", False):
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def check_rank_holds_its_shard(
    measured: dict[str, Any], checkpoint: dict[str, torch.Tensor], config: Any, tp: int
) -> None:
    """Every weight on the rank is its slice of the checkpoint: the shapes
    (1/T of each sharded tensor), the row and column sums (the right rows and
    columns: another rank's slice, or a slice out of order, fails)."""
    rank = measured["tp_rank"]
    expected = _expected_shards(checkpoint, config, tp, rank)
    got = measured["weights"]
    assert set(got) == set(expected), set(got) ^ set(expected)
    for name, want in expected.items():
        shape, row_sums, col_sums = got[name]
        want = want.to(torch.float32).double()
        assert shape == tuple(want.shape), (rank, name, shape, tuple(want.shape))
        want_rows = want.sum(-1) if want.dim() == 2 else want
        torch.testing.assert_close(row_sums, want_rows, rtol=1e-9, atol=1e-9, msg=f"{rank} {name}")
        if want.dim() == 2:
            torch.testing.assert_close(col_sums, want.sum(0), rtol=1e-9, atol=1e-9, msg=name)


def check_one_tth_per_rank(
    per_rank: list[dict[str, Any]], whole: dict[str, Any], config: Any, tp: int
) -> None:
    """Each rank holds 1/T of every sharded weight and of the KV cache (with
    fewer KV heads than ranks: one KV head per rank, so 1/num_kv_heads)."""
    kv_heads = config.num_key_value_heads
    kv_per = max(1, kv_heads // tp)
    for measured in per_rank:
        for name, (shape, _, _) in measured["weights"].items():
            full = whole["weights"][name][0]
            numel, full_numel = torch.Size(shape).numel(), torch.Size(full).numel()
            if "norm" in name:
                assert numel == full_numel, name
            elif "qkv_proj" in name and kv_heads < tp:
                heads = config.num_attention_heads
                assert numel == full_numel * (heads // tp + 2 * kv_per) // (heads + 2 * kv_heads)
            else:
                assert numel * tp == full_numel, (name, shape, full)
        assert measured["kv_heads"] == [kv_per]
        assert len(measured["kv_caches"]) == len(whole["kv_caches"])
        for (shape, nbytes), (full_shape, full_bytes) in zip(
            measured["kv_caches"], whole["kv_caches"]
        ):
            # (num_blocks, 2, block_size, num_kv_heads, head_size): every rank
            # has every block (page) of every layer, with its heads only.
            assert shape[:3] == full_shape[:3] and shape[3] == kv_per
            assert nbytes * kv_heads == full_bytes * kv_per
            if tp <= kv_heads:
                assert nbytes * tp == full_bytes


# --- the tiny Llama: T = 1, 2, 4 -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_config(tiny_model_dir: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    # T = 4 must copy KV heads (fewer KV heads than ranks), T = 2 must not.
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    return config


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{tiny_model_dir}/model.safetensors")


def _run(llm: LLM, prompts: list[Any], params: SamplingParams) -> tuple[list[Any], int]:
    before = llm.llm_engine.num_preemptions
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.llm_engine.num_preemptions - before


@pytest.fixture(scope="module")
def tiny_t1(tiny_model_dir: str) -> Iterator[LLM]:
    with _llm(tiny_model_dir, 1, **TINY_ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny_t1_run(tiny_t1: LLM) -> tuple[list[Any], int]:
    return _run(tiny_t1, TINY_PROMPTS, _greedy(TINY_TOKENS))


@pytest.fixture(scope="module", params=[2, 4], ids=["T2", "T4"])
def tiny_tp(request: pytest.FixtureRequest, tiny_model_dir: str) -> Iterator[tuple[int, LLM]]:
    with _llm(tiny_model_dir, request.param, **TINY_ENGINE) as llm:
        assert isinstance(_executor(llm), MultiprocExecutor)
        yield request.param, llm


def test_a_late_reply_is_not_taken_for_the_next_calls(tiny_tp: tuple[int, LLM]) -> None:
    """LLM.collective_rpc (vLLM's) with a timeout: every rank still answers the
    call that timed out, later; that answer is dropped, not returned to the
    next call. Mutation caught: the stale replies not drained (the next call
    returns "late" from each rank)."""
    tp, llm = tiny_tp
    with pytest.raises(TimeoutError, match="timed out"):
        llm.collective_rpc(sleep_then, timeout=0.2, args=(1.5, "late"))
    assert llm.collective_rpc(sleep_then, args=(0.0, "next")) == ["next"] * tp
    assert llm.collective_rpc("get_cpu_threads", kwargs={}) == llm.collective_rpc("get_cpu_threads")


def test_tiny_greedy_equals_t1_with_chunks_prefix_hits_and_preemption(
    tiny_tp: tuple[int, LLM], tiny_t1_run: tuple[list[Any], int], tokenizer: Any
) -> None:
    tp, llm = tiny_tp
    want, want_preempted = tiny_t1_run
    # The run is cut up as claimed: chunks, a prefix hit, a preemption.
    assert all(
        len(tokenizer.encode(p)) > TINY_ENGINE["max_num_batched_tokens"] for p in TINY_PROMPTS
    )
    assert want_preempted > 0
    assert any(o.num_cached_tokens > 0 for o in want)
    got, preempted = _run(llm, TINY_PROMPTS, _greedy(TINY_TOKENS))
    assert preempted == want_preempted  # the scheduler does not see T
    for g, w in zip(got, want):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), (tp, g.prompt)
        assert g.num_cached_tokens == w.num_cached_tokens


def test_each_tiny_rank_holds_its_shard_and_1_over_t(
    tiny_tp: tuple[int, LLM], tiny_t1: LLM, tiny_config: Any, tiny_checkpoint: Any
) -> None:
    tp, llm = tiny_tp
    per_rank = _executor(llm).collective_rpc(rank_shards)
    assert [m["tp_rank"] for m in per_rank] == list(range(tp))
    (whole,) = _executor(tiny_t1).collective_rpc(rank_shards)
    check_rank_holds_its_shard(whole, tiny_checkpoint, tiny_config, 1)
    for measured in per_rank:
        check_rank_holds_its_shard(measured, tiny_checkpoint, tiny_config, tp)
    check_one_tth_per_rank(per_rank, whole, tiny_config, tp)
    if tp == 4:  # ranks 0-1 hold KV head 0, ranks 2-3 KV head 1
        qkv = [m["weights"]["model.layers.0.self_attn.qkv_proj.weight"][1] for m in per_rank]
        head_dim = tiny_config.hidden_size // tiny_config.num_attention_heads
        kv_rows = [r[head_dim:] for r in qkv]  # after this rank's one query head
        assert torch.equal(kv_rows[0], kv_rows[1]) and torch.equal(kv_rows[2], kv_rows[3])
        assert not torch.equal(kv_rows[0], kv_rows[2])


# --- speculative decoding and structured outputs at T = 2 ---------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


def _spec_run(model: str, tp: int) -> tuple[list[list[int]], int, int]:
    """(tokens, drafted, accepted) of TINY_PROMPTS with n-gram drafts at T = tp."""
    from tests.test_spec_decode_engine import StepChecker

    with _llm(model, tp, speculative_config=NGRAM) as llm:
        checker = StepChecker(llm.llm_engine.engine_core.engine_core)
        outs = llm.generate(TINY_PROMPTS, _greedy(TINY_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], checker.drafted, checker.accepted


def test_ngram_speculative_decoding_at_t2_equals_t1(
    tiny_model_dir: str, tiny_t1_run: tuple[list[Any], int]
) -> None:
    t1 = _spec_run(tiny_model_dir, 1)
    t2 = _spec_run(tiny_model_dir, 2)
    assert t2 == t1  # tokens, drafts and accepted drafts alike
    tokens, drafted, accepted = t2
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    # And, greedy, what plain decoding gives.
    assert tokens == [list(o.outputs[0].token_ids) for o in tiny_t1_run[0]]


def test_json_schema_at_t2_and_t4_equals_t1(tiny_tp: tuple[int, LLM], tiny_t1: LLM) -> None:
    import jsonschema

    tp, llm = tiny_tp  # T = 2 and, the engine being there, T = 4
    so = StructuredOutputsParams(json=ANSWER_SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    prompts = TINY_PROMPTS[:2]
    want = tiny_t1.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
        # The grammar held at T = 2: the reply is the schema's, and it ended it.
        assert g.outputs[0].finish_reason == "stop", g.outputs[0]
        jsonschema.validate(json.loads(g.outputs[0].text), ANSWER_SCHEMA)


# --- the default model at T = 3 ------------------------------------------------------

DEFAULT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
DEFAULT_TOKENS = 12


@pytest.fixture(scope="module")
def hf_model(default_model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def default_prompt_ids(tokenizer: Any) -> list[list[int]]:
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in DEFAULT_PROMPTS
    ]


@pytest.fixture(scope="module")
def default_t3(default_model_dir: str) -> Iterator[LLM]:
    with _llm(default_model_dir, 3, num_gpu_blocks_override=32, max_model_len=512) as llm:
        yield llm


def test_default_model_at_t3_equals_t1_and_hf(
    default_t3: LLM, default_model_dir: str, default_prompt_ids: list[list[int]], hf_model: Any
) -> None:
    prompts = [{"prompt_token_ids": ids} for ids in default_prompt_ids]
    greedy = _greedy(DEFAULT_TOKENS)
    got = default_t3.generate(prompts, greedy, use_tqdm=False)
    with _llm(default_model_dir, 1, num_gpu_blocks_override=32, max_model_len=512) as t1:
        want = t1.generate(prompts, greedy, use_tqdm=False)
    for i, (g, w, ids) in enumerate(zip(got, want, default_prompt_ids)):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), i
        assert_lossless(
            g.outputs[0].token_ids, hf_greedy(hf_model, ids, DEFAULT_TOKENS), f"T=3 {i}"
        )


def test_each_default_rank_holds_a_third(default_t3: LLM, hf_model: Any) -> None:
    config = hf_model.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    checkpoint = dict(hf_model.state_dict())
    per_rank = _executor(default_t3).collective_rpc(rank_shards)
    assert [m["tp_rank"] for m in per_rank] == [0, 1, 2]
    whole = {
        "weights": {
            name: (tuple(t.shape), None, None)
            for name, t in _expected_shards(checkpoint, config, 1, 0).items()
        },
        # T = 1's KV cache: the same blocks with all 3 KV heads.
        "kv_caches": [
            (shape[:3] + (3,) + shape[4:], nbytes * 3) for shape, nbytes in per_rank[0]["kv_caches"]
        ],
    }
    for measured in per_rank:
        check_rank_holds_its_shard(measured, checkpoint, config, 3)
    check_one_tth_per_rank(per_rank, whole, config, 3)


# --- collectives in the trace ----------------------------------------------------------


def _trace(model: str, out_dir: str, detail: str, tp: int = 2) -> dict[str, Any]:
    """``tracevllm trace -tp T`` in a child process; its spans."""
    from tracevllm.tracing.exporters import read_spans_jsonl

    proc = subprocess.run(
        [sys.executable, "-m", "tracevllm.entrypoints.cli", "trace", "--prompt", "Hi there",
         "--max-tokens", "3", "--model", model, "-tp", str(tp), "--detail", detail,
         "--out", out_dir],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"spans": read_spans_jsonl(f"{out_dir}/spans.jsonl"), "stdout": proc.stdout}


def test_full_detail_traces_each_collective_on_every_rank(
    tiny_model_dir: str, tiny_config: Any, tmp_path: Any
) -> None:
    result = _trace(tiny_model_dir, str(tmp_path), "full")
    spans = result["spans"]
    by_id = {s.span_id: s for s in spans}
    assert len({s.trace_id for s in spans}) == 1  # one request, one trace
    runs = [s for s in spans if s.name == "ModelRunner.execute_model"]
    assert {s.resource["tracevllm.tp_rank"] for s in runs} == {0, 1}

    def run_of(span: Any) -> Any:
        while span.name != "ModelRunner.execute_model":
            span = by_id[span.parent_span_id]
        return span

    comms = [s for s in spans if s.name.startswith("GroupCoordinator.")]
    per_run = Counter((run_of(s).span_id, s.name) for s in comms)
    hidden, layers = tiny_config.hidden_size, tiny_config.num_hidden_layers
    # Three tokens: three forwards on each rank (a last step may run none).
    forwards = [s for s in spans if s.name == "LlamaForCausalLM.forward"]
    assert Counter(run_of(s).resource["tracevllm.tp_rank"] for s in forwards) == {0: 3, 1: 3}
    for run in {run_of(s).span_id: run_of(s) for s in forwards}.values():
        # Per forward: the embedding's all-reduce and two per layer (attention's
        # o_proj, the MLP's down_proj); the logits' all-gather.
        assert per_run[(run.span_id, "GroupCoordinator.all_reduce")] == 1 + 2 * layers
        assert per_run[(run.span_id, "GroupCoordinator.all_gather")] == 1
    for s in comms:
        assert s.process_kind == "worker" and s.pid == run_of(s).pid
        assert s.attributes["tracevllm.comm.group"] == "tp"
        assert s.attributes["tracevllm.comm.world_size"] == 2
        assert 0 <= s.attributes["tracevllm.comm.ms"] <= s.duration_ms + 1e-6
        nbytes = s.attributes["tracevllm.comm.bytes"]
        if s.name == "GroupCoordinator.all_reduce":
            assert nbytes % (hidden * 4) == 0 and nbytes > 0  # [num_tokens, hidden] fp32
        else:  # the logits, gathered: [num_reqs, padded vocab] fp32
            assert nbytes % (-(-tiny_config.vocab_size // 64) * 64 * 4) == 0
    # A layer's all-reduces are inside its span.
    in_layers = [s for s in comms if by_id[s.parent_span_id].name != "ModelRunner.execute_model"]
    assert any(by_id[s.parent_span_id].name == "LlamaDecoderLayer.forward" for s in in_layers)
    # The ranks view: who holds which layers and KV heads, and its collectives.
    from tracevllm.views.ranks import rank_rows

    rows = rank_rows(spans)
    assert [(r.rank, r.tp_rank, r.pp_rank) for r in rows] == [(0, 0, 0), (1, 1, 0)]
    for r in rows:
        assert r.layers == set(range(layers))
        assert r.kv_cache_shape is not None and r.kv_cache_shape[3] == 1  # 2 KV heads / 2
        assert r.pages and r.comms["all_reduce"][0] == 3 * (1 + 2 * layers)
        assert r.comms["all_gather"][0] == 3
    assert "Collectives, per rank" in result["stdout"]


def test_below_full_detail_no_collective_span(tiny_model_dir: str, tmp_path: Any) -> None:
    result = _trace(tiny_model_dir, str(tmp_path), "request")
    spans = result["spans"]
    runs = [s for s in spans if s.name == "ModelRunner.execute_model"]
    assert {s.resource["tracevllm.tp_rank"] for s in runs} == {0, 1}
    assert not [s for s in spans if s.name.startswith("GroupCoordinator.")]
    assert len({s.trace_id for s in spans}) == 1
    # The waterfall names each worker by its rank; the ranks view has no collectives.
    assert "W0" in result["stdout"] and "W1" in result["stdout"]
    assert "Ranks" in result["stdout"] and "Collectives, per rank" not in result["stdout"]


def traced_collectives(rank: int) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """On a gloo rank, at each detail: tracing on with an in-memory exporter,
    one of each collective, the spans made. With tracing off ``tracing.span``
    must not even be called (it raises then)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracevllm import tracing
    from tracevllm.config import TraceConfig
    from tracevllm.distributed.parallel_state import get_tp_group

    def no_span(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a span was asked for with tracing off")

    group = get_tp_group()
    x = torch.full((3, 4), float(rank + 1))
    made = {}
    for detail in ("off", "request", "full"):
        exporter = InMemorySpanExporter()
        processors = [SimpleSpanProcessor(exporter)]
        tracing.init_tracer("worker", TraceConfig(detail=detail), None, processors)
        span, tracing.span = tracing.span, no_span if detail == "off" else tracing.span
        try:
            reduced = group.all_reduce(x.clone())
            gathered = group.all_gather(x, dim=0)
            broadcast = group.broadcast(x.clone(), src=1)
            received = group.broadcast_tensor_dict({"t": x.clone(), "n": 7}, src=0)
            # A pipeline stage's hand-over: rank 0 sends, rank 1 receives.
            if rank == 0:
                group.send_tensor_dict({"hidden_states": x.clone(), "n": 1})
            else:
                passed = group.recv_tensor_dict()
                assert passed is not None and torch.equal(passed["hidden_states"], 1.0 + 0 * x)
        finally:
            tracing.span = span  # type: ignore[assignment]
        assert received is not None
        assert torch.equal(reduced, torch.full((3, 4), 3.0))
        assert torch.equal(gathered, torch.cat([torch.full((3, 4), 1.0), torch.full((3, 4), 2.0)]))
        assert torch.equal(broadcast, torch.full((3, 4), 2.0))
        assert torch.equal(received["t"], torch.full((3, 4), 1.0)) and received["n"] == 7
        tracing.shutdown_tracer()
        made[detail] = [(s.name, dict(s.attributes or {})) for s in exporter.get_finished_spans()]
    return made


def test_collective_spans_only_at_full_detail() -> None:
    from tests.parallel_utils import run_ranks

    for rank, made in enumerate(run_ranks(traced_collectives, 2)):
        assert made["off"] == [] and made["request"] == []
        spans = made["full"]
        hand_over = "send_tensor_dict" if rank == 0 else "recv_tensor_dict"
        assert [name for name, _ in spans] == [
            "GroupCoordinator.all_reduce",
            "GroupCoordinator.all_gather",
            "GroupCoordinator.broadcast",
            "GroupCoordinator.broadcast_tensor_dict",
            f"GroupCoordinator.{hand_over}",
        ]
        sizes = [attrs["tracevllm.comm.bytes"] for _, attrs in spans]
        assert sizes == [48, 96, 48, 48, 48]  # 3 x 4 fp32; the gathered result is twice that
        for _, attrs in spans:
            assert attrs["tracevllm.comm.group"] == "tp"
            assert attrs["tracevllm.comm.ms"] >= 0
            assert attrs["code.function.name"].startswith("GroupCoordinator.")
