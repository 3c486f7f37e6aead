"""KV connectors: a producer engine saves each prompt's KV, a consumer engine loads it.

Two LLMs on a tiny random-weight Llama through vLLM's ExampleConnector (files
on a shared path): the consumer's greedy tokens equal a single engine's (8
prompts x 48 tokens, the issue's workload), and
it computed only the tail of each prompt (``num_cached_tokens`` counts the
loaded tokens). A missing, corrupt or truncated file is recomputed (policy
``recompute``) or fails just that request (``fail``), and the engine keeps
serving; every KV block is back in the pool after each run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.test_scheduler import make_request
from tests.test_scheduler import runner_output as sched_runner_output
from tests.utils import make_tiny_llama
from tracevllm import LLM, SamplingParams
from tracevllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from tracevllm.core.kv_cache_manager import KVCacheBlocks
from tracevllm.core.sched.output import SchedulerOutput
from tracevllm.core.sched.scheduler import Scheduler
from tracevllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from tracevllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    COMPLETE_MARKER,
    num_tokens_to_transfer,
    prefix_key,
)
from tracevllm.engine import EngineCoreOutputs, FinishReason
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.outputs import KVConnectorOutput
from tracevllm.request import Request, RequestStatus

BLOCK_SIZE = 8
PROMPT_LENS = (21, 33, 40, 47, 9, 64, 30, 17)  # the issue: 8 prompts x 48 tokens
NUM_TOKENS = 48
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # N(0, 0.08) weights: greedy continuations that depend on the context.
    path = str(tmp_path_factory.mktemp("kv-tiny-llama"))
    return make_tiny_llama(path, seed=0, initializer_range=0.08)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 250, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _llm(model_dir: str, **kwargs: Any) -> LLM:
    kwargs.setdefault("enable_multiprocessing", False)
    return LLM(model=model_dir, block_size=BLOCK_SIZE, num_gpu_blocks_override=64, **kwargs)


def _kv(role: str, path: str, **kwargs: Any) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": path},
        **kwargs,
    }


def _greedy(kv_transfer_params: dict[str, Any] | None = None) -> SamplingParams:
    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, extra_args=extra_args
    )


def _inputs(prompts: list[list[int]]) -> list[Any]:
    return [{"prompt_token_ids": p} for p in prompts]


def _assert_pool_free(llm: LLM) -> None:
    stats = llm.llm_engine.engine_core.get_kv_cache_stats()
    assert stats["used"] == 0 and stats["free"] == stats["total"], stats


@pytest.fixture(scope="module")
def baseline(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    """A single engine's greedy tokens, without any connector."""
    with _llm(model_dir) as llm:
        outputs = llm.generate(_inputs(prompts), _greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _produce(model_dir: str, prompts: list[list[int]], path: str, **kwargs: Any) -> list[Any]:
    """The producer's run: max_tokens=1, the prompts' KV saved under ``path``."""
    with _llm(model_dir, kv_transfer_config=_kv("kv_producer", path), **kwargs) as producer:
        outputs = producer.generate(
            _inputs(prompts), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False
        )
        _assert_pool_free(producer)
    return outputs


@pytest.fixture(scope="module")
def stored(
    model_dir: str, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[dict[str, Any]]]:
    """One in-process producer run: the store and each prompt's kv_transfer_params."""
    path = str(tmp_path_factory.mktemp("kv-store"))
    outputs = _produce(model_dir, prompts, path)
    return path, [o.kv_transfer_params for o in outputs]


def _copy_store(stored: tuple[str, Any], tmp_path: Any) -> str:
    path = str(tmp_path / "store")
    shutil.copytree(stored[0], path)
    return path


def _layer_file(path: str, prompt: list[int], layer: str) -> str:
    key = prefix_key(prompt[: num_tokens_to_transfer(len(prompt), BLOCK_SIZE)])
    return os.path.join(path, key, f"{layer}.safetensors")


# ---------------------------------------------------------------- the config
def test_kv_transfer_config_is_checked_as_vllm_checks_it(model_dir: str) -> None:
    roles = re.escape("('kv_producer', 'kv_consumer', 'kv_both')")
    message = f"Please specify kv_role when kv_connector is set, supported roles are {roles}"
    with pytest.raises(ValueError, match=message):
        KVTransferConfig(kv_connector="ExampleConnector")
    with pytest.raises(ValueError, match=r"Unsupported kv_role: kv_prefill\. Supported roles"):
        KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_prefill")
    with pytest.raises(ValueError, match="kv_load_failure_policy must be 'recompute' or 'fail'"):
        KVTransferConfig(kv_role="kv_both", kv_load_failure_policy="retry")
    with pytest.raises(TypeError, match="kv_port must be an int, got bool"):
        KVTransferConfig(kv_port=True)
    with pytest.raises(TypeError, match="kv_connector_extra_config must be a dict"):
        KVTransferConfig(kv_connector_extra_config=["shared_storage_path"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown keys \['kv_connecter'\]"):
        KVTransferConfig.from_dict({"kv_connecter": "ExampleConnector", "kv_role": "kv_both"})
    config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    assert config.is_kv_producer and config.is_kv_consumer and config.engine_id
    assert config.kv_load_failure_policy == "fail"  # vLLM's default
    # Refused in the frontend, before an engine starts: vLLM's message.
    typo = {"kv_connector": "NixlConnectr", "kv_role": "kv_both"}
    with pytest.raises(ValueError, match="Unsupported connector type: NixlConnectr"):
        LLM(model=model_dir, kv_transfer_config=typo)
    # tracevllm serve --kv-transfer-config '{...}' parses to the same config.
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--kv-transfer-config", '{"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"}']
    )
    config = EngineArgs.from_cli_args(args).create_kv_transfer_config()
    assert config is not None and config.engine_id
    assert config == KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_consumer", engine_id=config.engine_id
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transfer-config", "[1]"])


# ------------------------------------------------------- producer -> consumer
@pytest.mark.parametrize("multiprocessing", ["0", "1"])
def test_consumer_generates_what_one_engine_does_from_the_producers_kv(
    model_dir: str,
    prompts: list[list[int]],
    baseline: list[list[int]],
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    multiprocessing: str,
) -> None:
    monkeypatch.setenv("TRACEVLLM_ENABLE_MULTIPROCESSING", multiprocessing)
    path = str(tmp_path / "store")
    # A 16-token budget: the longer prompts are saved in the step that
    # completes their kept blocks, not their first chunk.
    produced = _produce(
        model_dir, prompts, path, enable_multiprocessing=None, max_num_batched_tokens=16
    )
    for prompt, output in zip(prompts, produced, strict=True):
        assert output.kv_transfer_params == {"do_remote_prefill": True}
        folder = os.path.dirname(_layer_file(path, prompt, LAYERS[0]))
        assert sorted(os.listdir(folder)) == sorted(
            [COMPLETE_MARKER] + [f"{layer}.safetensors" for layer in LAYERS]
        )
    with _llm(
        model_dir, kv_transfer_config=_kv("kv_consumer", path), enable_multiprocessing=None
    ) as consumer:
        outputs = consumer.generate(
            _inputs(prompts), [_greedy(o.kv_transfer_params) for o in produced], use_tqdm=False
        )
        _assert_pool_free(consumer)
    for prompt, output, expected in zip(prompts, outputs, baseline, strict=True):
        assert list(output.outputs[0].token_ids) == expected, f"prompt of {len(prompt)}"
        # Loaded: the full blocks before the last prompt token; computed: the rest.
        assert output.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


# ----------------------------------------------------------- load failures
def _damage(path: str, prompts: list[list[int]]) -> None:
    """Prompt 0: a layer file of garbage; 1: a layer file gone; 2: one cut short."""
    with open(_layer_file(path, prompts[0], LAYERS[1]), "wb") as f:
        f.write(os.urandom(256))
    os.remove(_layer_file(path, prompts[1], LAYERS[0]))
    name = _layer_file(path, prompts[2], LAYERS[1])
    with open(name, "rb") as f:
        data = f.read()
    with open(name, "wb") as f:
        f.write(data[: len(data) // 2])


@pytest.mark.timeout(240)  # a request stuck after a failed load fails fast
def test_a_failed_load_is_recomputed_under_recompute(
    model_dir: str,
    prompts: list[list[int]],
    baseline: list[list[int]],
    stored: tuple[str, list[dict[str, Any]]],
    tmp_path: Any,
) -> None:
    path = _copy_store(stored, tmp_path)
    _damage(path, prompts)
    config = _kv("kv_consumer", path, kv_load_failure_policy="recompute")
    with _llm(model_dir, kv_transfer_config=config) as consumer:
        params = [_greedy(p) for p in stored[1]]
        for _ in range(2):  # and the engine keeps serving
            outputs = consumer.generate(_inputs(prompts), params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == baseline
            _assert_pool_free(consumer)


@pytest.mark.timeout(240)  # a request stuck after a failed load fails fast
def test_a_failed_load_fails_only_its_request_under_fail(
    model_dir: str,
    prompts: list[list[int]],
    baseline: list[list[int]],
    stored: tuple[str, list[dict[str, Any]]],
    tmp_path: Any,
) -> None:
    path = _copy_store(stored, tmp_path)
    _damage(path, prompts)
    with _llm(model_dir, kv_transfer_config=_kv("kv_consumer", path)) as consumer:
        params = [_greedy(p) for p in stored[1]]
        outputs = consumer.generate(_inputs(prompts), params, use_tqdm=False)
        for i, (output, expected) in enumerate(zip(outputs, baseline, strict=True)):
            completion = output.outputs[0]
            if i < 3:
                assert completion.finish_reason == "error", i
                assert completion.token_ids == [], i
            else:
                assert list(completion.token_ids) == expected, i
        _assert_pool_free(consumer)
        # The bad blocks left the prefix cache: with the files put right, the
        # same prompts load again, never hitting what the failed load left.
        shutil.rmtree(path)
        shutil.copytree(stored[0], path)
        outputs = consumer.generate(_inputs(prompts[:3]), params[:3], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == baseline[:3]
        _assert_pool_free(consumer)


@pytest.fixture
def no_connector_left() -> Iterator[None]:
    yield
    from tracevllm.distributed.kv_transfer import has_kv_transfer_group

    assert not has_kv_transfer_group(), "an engine left its KV connector behind"


def test_in_process_engines_never_share_a_connector(
    model_dir: str, tmp_path: Any, no_connector_left: None
) -> None:
    """Two live in-process engines with connectors would load and save
    through one another's: the second is refused, and a connector-less
    engine beside one runs untouched."""
    path = str(tmp_path / "store")
    with _llm(model_dir, kv_transfer_config=_kv("kv_producer", path)) as producer:
        with pytest.raises(RuntimeError, match="A KV connector is already running"):
            _llm(model_dir, kv_transfer_config=_kv("kv_consumer", path))
        with _llm(model_dir) as plain:
            plain.generate(_inputs([[7] * 30]), _greedy(), use_tqdm=False)
        assert not os.path.exists(path)  # the plain engine saved nothing
        producer.generate(_inputs([[7] * 30]), _greedy(), use_tqdm=False)
        assert os.listdir(path)


# ------------------------------------------------------------------ tracing
def test_saves_and_loads_are_spans_and_the_consumer_continues_the_producers_trace(
    model_dir: str, prompts: list[list[int]], baseline: list[list[int]], tmp_path: Any
) -> None:
    """Producer and consumer engines in their own processes, each writing spans:
    one save span per request on the producer and one load span per request
    on the consumer (bytes, blocks, layers, milliseconds), each in its
    request's trace; the consumer's request continues the producer's trace,
    whose context came in kv_transfer_params."""
    from tracevllm.tracing import SPANS_FILE
    from tracevllm.tracing.exporters import read_spans_jsonl

    path, traces = str(tmp_path / "store"), tmp_path / "traces"
    two = prompts[1:3]
    traced = {"trace_detail": "request", "enable_multiprocessing": True}
    with _llm(
        model_dir,
        kv_transfer_config=_kv("kv_producer", path),
        trace_dir=str(traces / "producer"),
        **traced,
    ) as producer:
        produced = producer.generate(
            _inputs(two), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False
        )
    for output in produced:
        assert output.kv_transfer_params is not None
        assert output.kv_transfer_params["traceparent"].startswith("00-")
    with _llm(
        model_dir,
        kv_transfer_config=_kv("kv_consumer", path),
        trace_dir=str(traces / "consumer"),
        **traced,
    ) as consumer:
        params = [_greedy(o.kv_transfer_params) for o in produced]
        outputs = consumer.generate(_inputs(two), params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == baseline[1:3]

    p_spans = read_spans_jsonl(str(traces / "producer" / SPANS_FILE))
    c_spans = read_spans_jsonl(str(traces / "consumer" / SPANS_FILE))
    # [2, 1, 2, 2] bytes per value: K and V, tiny Llama's 2 KV heads of 16, fp32, 2 layers.
    bytes_per_token = 2 * 2 * 16 * 4 * len(LAYERS)
    for direction, spans, name in (
        ("save", p_spans, "ExampleConnector.save_kv_layer"),
        ("load", c_spans, "ExampleConnector.wait_for_layer_load"),
    ):
        transfers = sorted(
            (s for s in spans if s.name == name),
            key=lambda s: s.attributes["tracevllm.kv_transfer.num_tokens"],
        )
        assert len(transfers) == 2, (direction, [s.name for s in spans])
        for span, prompt in zip(transfers, two, strict=True):
            kept = num_tokens_to_transfer(len(prompt), BLOCK_SIZE)
            attrs = span.attributes
            assert attrs["tracevllm.kv_transfer.connector"] == "ExampleConnector"
            assert attrs["tracevllm.kv_transfer.direction"] == direction
            assert attrs["tracevllm.kv_transfer.num_tokens"] == kept
            assert attrs["tracevllm.kv_transfer.num_blocks"] == kept // BLOCK_SIZE
            assert attrs["tracevllm.kv_transfer.num_layers"] == len(LAYERS)
            assert attrs["tracevllm.kv_transfer.num_bytes"] == kept * bytes_per_token
            assert attrs["tracevllm.kv_transfer.ms"] >= 0
            assert span.process_kind == "engine_core"
        # Each under its own request's llm_request span (made in the frontend).
        request_span_ids = {s.span_id for s in spans if s.name == "llm_request"}
        parents = {s.parent_span_id for s in transfers}
        assert len(parents) == 2 and parents <= request_span_ids, direction
    # One trace per request, from the producer's llm_request to the consumer's.
    p_requests = {s.span_id: s for s in p_spans if s.name == "llm_request"}
    c_requests = [s for s in c_spans if s.name == "llm_request"]
    assert len(p_requests) == len(c_requests) == 2
    for c_request in c_requests:
        parent = p_requests[c_request.parent_span_id]  # type: ignore[index]
        assert parent.trace_id == c_request.trace_id


# --- the scheduler's asynchronous-load path, with a connector that moves nothing ---


class _FakeMetadata(KVConnectorMetadata):
    pass


class AsyncFakeConnector(KVConnectorBase_V1):
    """A scheduler-side connector shaped as vLLM's NixlConnector's: a request
    with ``do_remote_prefill`` loads its whole prompt asynchronously (or its
    first ``num_remote_tokens``; synchronously with ``load_async`` False); one with
    ``do_remote_decode`` leaves its blocks held for a remote reader. The tests
    play the workers (``KVConnectorOutput``)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            # The prompt's first num_remote_tokens (all of it by default).
            num_remote = params.get("num_remote_tokens", len(request.prompt_token_ids))
            count = num_remote - num_computed_tokens
            if count > 0:
                return count, params.get("load_async", True)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False  # once: a preempted request recomputes

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _FakeMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        if (
            params.get("do_remote_decode")
            and request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        ):
            return True, {"do_remote_prefill": True, "remote_block_ids": block_ids}
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...


def _async_scheduler(policy: str = "recompute", role: str = "kv_both") -> Scheduler:
    """A scheduler alone (block size 4, 63 usable blocks) with the fake connector."""
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
    }
    cache_config = CacheConfig(block_size=4)
    cache_config.num_gpu_blocks = 64
    config = VllmConfig(
        ModelConfig(model="fake", hf_config=hf_config, max_model_len=64),
        cache_config,
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=64),
        kv_transfer_config=KVTransferConfig(
            kv_connector="AsyncFakeConnector",
            kv_connector_module_path="tests.test_kv_connector",
            kv_role=role,
            kv_load_failure_policy=policy,
        ),
    )
    return Scheduler(config)


def _remote(req_id: str, prompt: list[int], **params: Any) -> Request:
    return make_request(req_id, prompt, max_tokens=4, extra_args={"kv_transfer_params": params})


def _report(sched: Scheduler, so: SchedulerOutput, **kv: Any) -> dict[int, EngineCoreOutputs]:
    """One step's runner output, with what the workers' connectors report."""
    out = sched_runner_output(sched, so)
    out.kv_connector_output = KVConnectorOutput(**kv)
    return sched.update_from_output(so, out)


def _held_blocks(sched: Scheduler, req_id: str) -> list[int]:
    (block_ids,) = sched.kv_cache_manager.get_block_ids(req_id)
    return block_ids


def _num_free(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


PROMPT10 = list(range(100, 110))  # 10 tokens: two full blocks of 4 and a partial one


def test_an_async_load_waits_with_its_blocks_allocated_but_not_cached() -> None:
    sched = _async_scheduler()
    free0 = _num_free(sched)
    sched.add_request(_remote("a", PROMPT10, do_remote_prefill=True))
    so = sched.schedule()
    req = sched.requests["a"]
    # Nothing runs; the whole prompt's slots are held, none of them cached
    # (mutation caught: delay_cache_blocks ignored).
    assert so.num_scheduled_tokens == {}
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.num_computed_tokens == 10
    blocks = _held_blocks(sched, "a")
    assert len(blocks) == 3 and _num_free(sched) == free0 - 3
    pool = sched.kv_cache_manager.block_pool
    assert all(pool.blocks[b].block_hash is None for b in blocks)
    _report(sched, so)

    # A request with the same prompt, arriving while the load runs, gets no
    # hit on blocks that hold nothing yet: it computes its whole prompt.
    sched.add_request(make_request("b", PROMPT10, max_tokens=4))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 10}
    assert sched.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _report(sched, so, finished_recving={"a"})

    # Loaded: cached now, and only the last prompt token runs (for its logits).
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 1, "a": 1}
    assert [d.req_id for d in so.scheduled_new_reqs] == ["a"]
    assert _held_blocks(sched, "a") == blocks
    assert all(pool.blocks[b].block_hash is not None for b in blocks[:2])
    _report(sched, so)
    while sched.has_requests():
        _report(sched, sched.schedule())
    assert _num_free(sched) == free0


def test_a_failed_async_load_recomputes_from_its_first_bad_block() -> None:
    sched = _async_scheduler("recompute")
    sched.add_request(_remote("a", PROMPT10, do_remote_prefill=True))
    _report(sched, so := sched.schedule())
    blocks = _held_blocks(sched, "a")
    # The second block failed; the load is over.
    _report(sched, sched.schedule(), invalid_block_ids={blocks[1]}, finished_recving={"a"})
    so = sched.schedule()
    # Tokens 4..9 recomputed into the same blocks (mutation caught: async
    # requests left out of the invalid-block scan runs 1 token).
    assert so.num_scheduled_tokens == {"a": 6}
    assert _held_blocks(sched, "a") == blocks
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    _report(sched, so)
    while sched.has_requests():
        _report(sched, sched.schedule())
    assert _num_free(sched) == sched.kv_cache_manager.block_pool.get_num_usable_blocks()


def test_a_failed_async_load_fails_its_request_and_frees_its_blocks_once_done() -> None:
    sched = _async_scheduler("fail")
    free0 = _num_free(sched)
    sched.add_request(_remote("a", PROMPT10, do_remote_prefill=True))
    sched.add_request(make_request("b", 6, max_tokens=3))
    _report(sched, sched.schedule())
    blocks = _held_blocks(sched, "a")
    # The failure is reported before the transfer has ended.
    eco = _report(sched, sched.schedule(), invalid_block_ids={blocks[0]})
    (failed,) = [o for o in eco[0].outputs if o.request_id == "a"]
    assert failed.finish_reason == FinishReason.ERROR
    assert failed.stop_reason == "KV cache load failed"
    # The transfer may still write them: held (mutation caught: freed at once).
    assert _held_blocks(sched, "a") == blocks
    _report(sched, sched.schedule(), finished_recving={"a"})
    assert "a" not in sched.requests
    while sched.has_requests():
        _report(sched, sched.schedule())
    assert _num_free(sched) == free0  # and b, beside it, ran to its end


def test_an_aborted_async_load_keeps_its_blocks_until_the_load_ends() -> None:
    sched = _async_scheduler()
    free0 = _num_free(sched)
    sched.add_request(_remote("a", PROMPT10, do_remote_prefill=True))
    _report(sched, sched.schedule())
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert _num_free(sched) == free0 - 3 and sched.has_requests()
    _report(sched, sched.schedule(), finished_recving={"a"})
    assert _num_free(sched) == free0 and not sched.has_requests()


def test_a_producer_holds_its_blocks_until_they_are_sent() -> None:
    sched = _async_scheduler(role="kv_producer")
    free0 = _num_free(sched)
    req = make_request(
        "p", PROMPT10, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
    )
    sched.add_request(req)
    eco = _report(sched, sched.schedule())
    (out,) = eco[0].outputs
    assert out.finish_reason == FinishReason.LENGTH
    assert out.kv_transfer_params == {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3]}
    # Finished, but its blocks wait for the reader (mutation caught:
    # request_finished's delay_free_blocks ignored).
    assert _num_free(sched) == free0 - 3
    assert sched.has_requests() and not sched.has_unfinished_requests()
    _report(sched, sched.schedule())
    assert _num_free(sched) == free0 - 3
    _report(sched, sched.schedule(), finished_sending={"p"})
    assert _num_free(sched) == free0 and not sched.has_requests()


@pytest.mark.timeout(60)  # bounded below; a hang elsewhere still fails
def test_loaded_requests_holding_every_free_block_give_one_back() -> None:
    """Six 56-token prompts (14 blocks of 4) in a 63-block pool, each loading
    part of its prompt asynchronously: a 1 block, b to e 13 blocks each (b
    to d loaded in the first step, e later), f 1 block. Once loaded they
    wait holding their blocks; a, at the head, needs 13 more and 10 are
    free. Nothing runs, so vLLM's waiting pass would break every step from
    then on. Here the youngest loaded request (d; e is still loading and
    keeps its blocks) gives its blocks back, a runs, and all six finish."""
    sched = _async_scheduler()
    free0 = _num_free(sched)
    outputs: list[EngineCoreOutputs] = []

    def report(so: SchedulerOutput, **kv: Any) -> None:
        outputs.extend(_report(sched, so, **kv).values())

    loads = {"a": 4, "b": 52, "c": 52, "d": 52, "e": 52, "f": 4}
    for i, (req_id, num_remote) in enumerate(loads.items()):
        prompt = list(range(100 * i + 1, 100 * i + 57))
        params = {"do_remote_prefill": True, "num_remote_tokens": num_remote}
        sched.add_request(
            make_request(
                req_id,
                prompt,
                max_tokens=4,
                arrival_time=float(i),
                extra_args={"kv_transfer_params": params},
            )
        )
    so = sched.schedule()
    # f's whole sequence would not fit besides the others' loads: not
    # admitted (vLLM's full_sequence_must_fit gate; mutation caught: no gate).
    assert {r.request_id for r in sched.skipped_waiting} == set("abcde")
    assert sched.requests["f"].status == RequestStatus.WAITING
    assert _held_blocks(sched, "f") == [] and _num_free(sched) == 10
    e_blocks = _held_blocks(sched, "e")
    report(so, finished_recving=set("abcd"))

    # a cannot get its 13 blocks: d gives back its 13 (cached, not lost).
    so = sched.schedule()
    assert so.num_scheduled_tokens == {}
    assert _held_blocks(sched, "d") == [] and sched.requests["d"].num_computed_tokens == 0
    assert _held_blocks(sched, "e") == e_blocks
    report(so)
    so = sched.schedule()
    assert so.num_scheduled_tokens["a"] == 52  # a runs
    report(so)

    # Bounded: a wedged scheduler steps without end (mutation caught: no
    # request gives its blocks back -> 200 steps, nothing scheduled).
    for num_steps in range(200):
        if not sched.has_requests():
            break
        so = sched.schedule()
        e = sched.requests.get("e")
        if e is not None and e.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert _held_blocks(sched, "e") == e_blocks  # still loading: never freed
        # Each load ends with the step that starts it (e's, late, at step 5).
        loading = {
            r.request_id
            for r in sched.skipped_waiting
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and r.request_id not in sched.finished_recving_kv_req_ids
        }
        if num_steps < 5:
            loading.discard("e")
        report(so, finished_recving=loading)
    assert not sched.has_requests(), {
        r.request_id: (r.status, r.num_computed_tokens) for r in sched.requests.values()
    }
    assert _num_free(sched) == free0

    # d, admitted again after giving back, is counted once, its loaded
    # tokens still external, not local hits (mutation caught: the
    # gave_back_loaded_blocks checks dropped -> 7 lookups, d's 52 local).
    lookups = [o.scheduler_stats.connector_prefix_cache_stats for o in outputs if o.scheduler_stats]
    assert sum(s.requests for s in lookups if s) == 6
    assert sum(s.queries for s in lookups if s) == 6 * 56
    assert sum(s.hits for s in lookups if s) == sum(loads.values())
    prefill = [o for outs in outputs for o in outs.outputs if o.prefill_stats]
    assert {o.request_id: o.prefill_stats.num_external_cached_tokens for o in prefill} == loads
    assert {o.request_id: o.prefill_stats.num_local_cached_tokens for o in prefill} == (
        dict.fromkeys(loads, 0)
    )


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_blocks_that_failed_a_sync_load_leave_the_prefix_cache(policy: str) -> None:
    """A synchronous load of 8 tokens (2 blocks, cached as they are
    allocated) whose second block fails: under both policies that block
    leaves the prefix cache, so a request with the same prompt arriving
    before the owner has recomputed it hits only the first block (vLLM
    evicts under "fail" only; mutation caught: the same here)."""
    sched = _async_scheduler(policy)
    sched.add_request(
        _remote("a", PROMPT10, do_remote_prefill=True, num_remote_tokens=8, load_async=False)
    )
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 2}  # 8 tokens loaded with the step
    blocks = _held_blocks(sched, "a")
    pool = sched.kv_cache_manager.block_pool
    assert all(pool.blocks[b].block_hash is not None for b in blocks[:2])
    _report(sched, so, invalid_block_ids={blocks[1]})
    assert pool.blocks[blocks[0]].block_hash is not None
    assert pool.blocks[blocks[1]].block_hash is None
    sched.add_request(make_request("b", PROMPT10, max_tokens=4))
    so = sched.schedule()
    assert so.num_scheduled_tokens["b"] == 6  # hit: the first block only
    if policy == "recompute":
        assert so.num_scheduled_tokens["a"] == 6  # from its bad block on
    else:
        assert "a" not in sched.requests
    _report(sched, so)
    while sched.has_requests():
        _report(sched, sched.schedule())
    assert _num_free(sched) == sched.kv_cache_manager.block_pool.get_num_usable_blocks()
