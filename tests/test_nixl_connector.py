"""NixlConnector: a prefill engine's KV blocks read by a decode engine over NIXL.

Each engine runs in its own process (a process holds one worker-side
connector), on a tiny random-weight Llama. The producer runs each prompt with
``max_tokens=1`` and holds its blocks; the consumer, given the returned
``kv_transfer_params``, reads them (UCX, host memory to host memory) while
the request waits in ``WAITING_FOR_REMOTE_KVS``, and generates what a single
engine does, having computed only the prompt's last token. A producer that
cannot be reached is recomputed (``recompute``) or fails just its request
(``fail``); blocks no one reads are freed after
``TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT``; every block comes back on both sides.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.utils import make_tiny_llama
from tracevllm import LLM, SamplingParams

pytest.importorskip("nixl")

BLOCK_SIZE = 8
PROMPT_LENS = (21, 33, 40, 47, 9, 64, 30, 17)
NUM_TOKENS = 48
NUM_BLOCKS = 96


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("nixl-tiny-llama"))
    return make_tiny_llama(path, seed=0, initializer_range=0.08)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(5, 250, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _greedy(params: dict[str, Any] | None = None, max_tokens: int = NUM_TOKENS) -> SamplingParams:
    extra_args = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args
    )


def _inputs(prompts: list[list[int]]) -> list[Any]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def baseline(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(
        model=model_dir,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS,
        enable_multiprocessing=False,
    ) as llm:
        outputs = llm.generate(_inputs(prompts), _greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _engine(
    model_dir: str, role: str, env: dict[str, str], trace_dir: str | None = None, **kv: Any
) -> LLM:
    """An engine in its own process: the side-channel port (and any other
    setting) is read from the environment the engine process starts with."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return LLM(
            model=model_dir,
            block_size=BLOCK_SIZE,
            num_gpu_blocks_override=NUM_BLOCKS,
            enable_multiprocessing=True,
            kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": role, **kv},
            **({"trace_dir": trace_dir, "trace_detail": "request"} if trace_dir else {}),
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _port_env(port: int, **more: str) -> dict[str, str]:
    return {"TRACEVLLM_NIXL_SIDE_CHANNEL_PORT": str(port), **more}


@pytest.fixture(scope="module")
def trace_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the shared producer and consumer write their spans."""
    return str(tmp_path_factory.mktemp("nixl-traces"))


@pytest.fixture(scope="module")
def producer(model_dir: str, trace_root: str) -> Iterator[LLM]:
    trace_dir = os.path.join(trace_root, "producer")
    with _engine(model_dir, "kv_producer", _port_env(_free_port()), trace_dir) as llm:
        yield llm


@pytest.fixture(scope="module")
def consumer(model_dir: str, trace_root: str) -> Iterator[LLM]:
    env = _port_env(_free_port())
    trace_dir = os.path.join(trace_root, "consumer")
    with _engine(
        model_dir,
        "kv_consumer",
        env,
        trace_dir,
        kv_load_failure_policy="recompute",
        # A read must end 3 s before the producer's expiry (the default 10 s
        # would leave the timeout test's short-lived producer too little).
        kv_connector_extra_config={"kv_expiry_margin": 3},
    ) as llm:
        yield llm


@pytest.fixture(scope="module")
def failing_consumer(model_dir: str) -> Iterator[LLM]:
    env = _port_env(_free_port())
    with _engine(model_dir, "kv_consumer", env, kv_load_failure_policy="fail") as llm:
        yield llm


def _stats(llm: LLM) -> dict[str, int]:
    return llm.llm_engine.engine_core.get_kv_cache_stats()


def _wait_pool_free(llm: LLM, timeout: float = 60.0) -> dict[str, int]:
    """The engine frees held blocks in its own loop: poll until all are back."""
    deadline = time.monotonic() + timeout
    while (stats := _stats(llm))["used"] and time.monotonic() < deadline:
        time.sleep(0.2)
    return stats


def _prefill(producer: LLM, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outputs = producer.generate(
        _inputs(prompts), _greedy({"do_remote_decode": True}, max_tokens=1), use_tqdm=False
    )
    params = [o.kv_transfer_params for o in outputs]
    assert all(p and p["do_remote_prefill"] and p["remote_block_ids"] for p in params)
    return params


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.timeout(600)
def test_the_consumer_reads_the_producers_blocks_and_generates_what_one_engine_does(
    producer: LLM, consumer: LLM, prompts: list[list[int]], baseline: list[list[int]]
) -> None:
    params = _prefill(producer, prompts[:6])
    # The producer holds each prompt's blocks for the reader (mutation caught:
    # request_finished's delay_free_blocks dropped).
    held = sum(len(p["remote_block_ids"]) for p in params)
    assert held == sum(_cdiv(len(p), BLOCK_SIZE) for p in prompts[:6])
    assert _stats(producer)["used"] == held
    # Six remote prefills and two plain requests, in one batch: the plain
    # ones run while the reads are in flight.
    sampling = [_greedy(p) for p in params] + [_greedy(), _greedy()]
    outputs = consumer.generate(_inputs(prompts), sampling, use_tqdm=False)
    # Token for token a single engine's (mutations caught: the READ skipped,
    # the wrong layer's descriptors read).
    assert [list(o.outputs[0].token_ids) for o in outputs] == baseline
    # The remote prompts were loaded, not computed: every prompt token counts
    # as cached (the last one runs again, for its logits); the plain ones
    # computed theirs.
    assert [o.num_cached_tokens for o in outputs[:6]] == [len(p) for p in prompts[:6]]
    assert all(o.num_cached_tokens < len(p) for o, p in zip(outputs[6:], prompts[6:]))
    # Every block back: the producer's once the reader has said so (its
    # timeout is 480 s: only the notifications can free them this soon).
    assert _wait_pool_free(producer)["used"] == 0
    assert _wait_pool_free(consumer)["used"] == 0


@pytest.mark.timeout(600)
def test_a_local_prefix_hit_reads_only_the_rest(
    producer: LLM, consumer: LLM, prompts: list[list[int]], baseline: list[list[int]]
) -> None:
    # The consumer has prompt 6's blocks cached from a plain run; a longer
    # prompt sharing them reads only the blocks past the hit (mutation caught:
    # the remote blocks taken from the front).
    prompt = prompts[6]
    consumer.generate(_inputs([prompt[:24]]), _greedy(max_tokens=1), use_tqdm=False)
    (params,) = _prefill(producer, [prompt])
    (output,) = consumer.generate(_inputs([prompt]), _greedy(params), use_tqdm=False)
    assert list(output.outputs[0].token_ids) == baseline[6]
    assert _wait_pool_free(producer)["used"] == 0
    assert _wait_pool_free(consumer)["used"] == 0


def _unreachable(params: dict[str, Any]) -> dict[str, Any]:
    """The same request, its producer's side channel gone (nothing listens)."""
    return {**params, "remote_port": _free_port(), "remote_engine_id": "gone"}


@pytest.mark.timeout(600)
def test_an_unreachable_producer_is_recomputed_under_recompute(
    producer: LLM, consumer: LLM, prompts: list[list[int]], baseline: list[list[int]]
) -> None:
    params = _prefill(producer, prompts[:2])
    bad = _unreachable(params[0])
    outputs = consumer.generate(
        _inputs(prompts[:3]), [_greedy(bad), _greedy(params[1]), _greedy()], use_tqdm=False
    )
    # Recomputed from the first block that did not load: the same tokens
    # (mutation caught: the handshake failure not reported, the request
    # waits forever). The other remote prefill in the batch still loads.
    assert [list(o.outputs[0].token_ids) for o in outputs] == baseline[:3]
    assert outputs[1].num_cached_tokens == len(prompts[1])
    # The unread request's blocks stay held on the producer until its timeout
    # (480 s); the consumer gave back everything.
    assert _stats(producer)["used"] == len(params[0]["remote_block_ids"])
    assert _wait_pool_free(consumer)["used"] == 0


@pytest.mark.timeout(600)
def test_hostile_kv_transfer_params_are_computed_locally(
    producer: LLM, consumer: LLM, prompts: list[list[int]], baseline: list[list[int]]
) -> None:
    """kv_transfer_params come from the client: a malformed one, or one that
    names another prompt's blocks, is refused before the scheduler or the
    worker uses it (vLLM's warning), the prompt is computed, and the engine
    serves on. Before, do_remote_prefill alone tripped an assert in the
    scheduler and remote_block_ids=5 a TypeError in the engine core."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
        remote_prefill_params_problem,
    )

    (good,) = _prefill(producer, prompts[6:7])
    n = len(prompts[6])
    assert remote_prefill_params_problem(good, n) is None
    hostile = [
        {"do_remote_prefill": True},
        {**good, "remote_block_ids": 5},
        {**good, "remote_block_ids": ["a"]},
        {**good, "remote_block_ids": [True]},
        {**good, "remote_block_ids": [-1]},
        {**good, "remote_port": "5600"},
        {**good, "remote_port": 70000},
        {**good, "remote_host": None},
        {**good, "do_remote_prefill": 1},
        {**good, "remote_num_tokens": n + 16},  # a longer prompt's blocks
        {k: v for k, v in good.items() if k != "remote_expiration_time"},
        {k: v for k, v in good.items() if k != "remote_params_mac"},
        {**good, "remote_notif_token": "a:b"},
    ]
    for params in hostile:
        assert remote_prefill_params_problem(params, n) is not None, params
    outputs = consumer.generate(
        _inputs([prompts[6]] * len(hostile)),
        [_greedy(dict(p)) for p in hostile],
        use_tqdm=False,
    )
    assert [list(o.outputs[0].token_ids) for o in outputs] == [baseline[6]] * len(hostile)
    # Well-formed, but with a later expiry than the producer's (a replay of
    # old params made to look fresh): the producer's MAC over them no longer
    # matches, so the consumer does not read (no READ, so no notification:
    # the producer still holds the blocks) and computes the prompt (mutation
    # caught: the MAC not checked -> read, and the blocks freed).
    held = _stats(producer)["used"]
    forged = {**good, "remote_expiration_time": good["remote_expiration_time"] + 600}
    assert remote_prefill_params_problem(forged, n) is None
    (computed,) = consumer.generate(_inputs([prompts[6]]), [_greedy(forged)], use_tqdm=False)
    assert list(computed.outputs[0].token_ids) == baseline[6]
    time.sleep(1)  # a notification would have freed them by now (the producer polls at 10 ms)
    assert _stats(producer)["used"] == held
    # The good params still load (and free the producer's held blocks).
    (loaded,) = consumer.generate(_inputs([prompts[6]]), [_greedy(good)], use_tqdm=False)
    assert list(loaded.outputs[0].token_ids) == baseline[6]
    deadline = time.monotonic() + 30
    while _stats(producer)["used"] != held - len(good["remote_block_ids"]):
        assert time.monotonic() < deadline, "the good read's notification never came"
        time.sleep(0.2)
    assert _wait_pool_free(consumer)["used"] == 0


@pytest.mark.timeout(300)
def test_an_engine_serves_on_after_a_remote_prefill_aborted_before_it_was_scheduled(
    model_dir: str, prompts: list[list[int]], baseline: list[list[int]]
) -> None:
    """A request with do_remote_prefill alone, aborted before the scheduler
    saw it (in one engine core, in process, so that the add and the abort
    come before the step for sure): the next step runs and the engine
    serves on. Before, Scheduler.schedule() raised KeyError
    'remote_block_ids' from build_connector_meta, which in a server kills
    the engine core (mutation caught: the old unchecked request_finished and
    build_connector_meta)."""
    with LLM(
        model=model_dir,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS,
        enable_multiprocessing=False,
        kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
    ) as llm:
        engine = llm.llm_engine
        engine.add_request(
            "gone", {"prompt_token_ids": prompts[0]}, _greedy({"do_remote_prefill": True})
        )
        engine.abort_request(["gone"])
        (output,) = llm.generate(_inputs(prompts[1:2]), _greedy(max_tokens=4), use_tqdm=False)
        assert list(output.outputs[0].token_ids) == baseline[1][:4]


@pytest.mark.timeout(600)
def test_an_unreachable_producer_fails_only_its_request_under_fail(
    producer: LLM, failing_consumer: LLM, prompts: list[list[int]], baseline: list[list[int]]
) -> None:
    params = _prefill(producer, prompts[2:4])
    bad = _unreachable(params[0])
    outputs = failing_consumer.generate(
        _inputs(prompts[2:5]), [_greedy(bad), _greedy(params[1]), _greedy()], use_tqdm=False
    )
    failed = outputs[0].outputs[0]
    assert failed.finish_reason == "error" and list(failed.token_ids) == []
    assert failed.stop_reason == "KV cache load failed"
    assert [list(o.outputs[0].token_ids) for o in outputs[1:]] == baseline[3:5]
    # And it keeps serving.
    (again,) = failing_consumer.generate(_inputs(prompts[5:6]), _greedy(), use_tqdm=False)
    assert list(again.outputs[0].token_ids) == baseline[5]
    assert _wait_pool_free(failing_consumer)["used"] == 0


@pytest.mark.timeout(600)
def test_unread_blocks_are_freed_after_the_timeout_and_a_dead_producer_is_recomputed(
    model_dir: str, consumer: LLM, prompts: list[list[int]], baseline: list[list[int]]
) -> None:
    timeout = 45
    env = _port_env(_free_port(), TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT=str(timeout))
    with _engine(model_dir, "kv_producer", env) as short:
        # A throwaway read first: the consumer's handshake with this producer
        # (which the dead-producer part below needs) comes before the clock
        # below starts, so nothing asserted depends on how long a cold
        # handshake takes. On a machine too slow to read within the expiry
        # the prompt is recomputed and its blocks expire instead: the same
        # tokens, and the pool is empty either way. (Whether a reader's
        # notification frees the blocks is checked on the module's producer,
        # whose 480 s timeout cannot be mistaken for it.)
        (warm,) = _prefill(short, prompts[:1])
        (read,) = consumer.generate(
            _inputs(prompts[:1]), [_greedy(warm, max_tokens=4)], use_tqdm=False
        )
        assert list(read.outputs[0].token_ids) == baseline[0][:4]
        assert _wait_pool_free(short, timeout=90)["used"] == 0
        # Before the prefill: the producer's expiry counts from its request's end.
        start = time.monotonic()
        params = _prefill(short, prompts[1:3])
        assert _stats(short)["used"] == sum(len(p["remote_block_ids"]) for p in params)
        # Never read: freed after the timeout, not before (mutation caught:
        # no expiry, never freed).
        assert _wait_pool_free(short, timeout=90)["used"] == 0
        assert time.monotonic() - start >= timeout - 1

        # A reader that comes after the expiry (its blocks may hold another
        # request's KV by now) does not read: the prompt is recomputed, the
        # same tokens (mutation caught: the consumer's expiry check removed
        # -> the freed blocks are read, every prompt token counted cached).
        (late,) = consumer.generate(_inputs(prompts[1:2]), [_greedy(params[0])], use_tqdm=False)
        assert list(late.outputs[0].token_ids) == baseline[1]
        assert late.num_cached_tokens < len(prompts[1])

        # The producer dies after the handshake: reads from it fail, and the
        # consumer recomputes and keeps serving.
        (fresh,) = _prefill(short, prompts[2:3])
        proc = short.llm_engine.engine_core.resources.proc
        assert proc is not None and proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        outputs = consumer.generate(
            _inputs(prompts[2:4]), [_greedy(fresh), _greedy()], use_tqdm=False
        )
        assert [list(o.outputs[0].token_ids) for o in outputs] == baseline[2:4]
        assert outputs[0].num_cached_tokens < len(prompts[2])
    assert _wait_pool_free(consumer)["used"] == 0


def _spans(trace_dir: str, name: str, req_ids: list[str], timeout: float = 60.0) -> list[Any]:
    """The spans named ``name`` of these engine request ids (or ids starting
    with one and a dash: the engine's own ids), from an engine's spans file,
    once there is one per request (the engine writes its spans in batches)."""
    from tracevllm.tracing import SPANS_FILE
    from tracevllm.tracing.exporters import read_spans_jsonl

    def owner(span: Any) -> int:
        req_id = span.attributes["tracevllm.kv_transfer.request_id"]
        for i, wanted in enumerate(req_ids):
            if req_id == wanted or req_id.startswith(wanted + "-"):
                return i
        return -1

    path = os.path.join(trace_dir, SPANS_FILE)
    # Only the batches that hold such a span are parsed: a producer holding
    # blocks steps (and writes step spans) all the while, and by the end of
    # the module its file is some hundred MB, which took ~2 minutes to parse.
    filtered = os.path.join(trace_dir, "filtered-" + SPANS_FILE)
    deadline = time.monotonic() + timeout
    while True:
        spans = []
        if os.path.exists(path):
            needle = f'"{name}"'.encode()
            with open(path, "rb") as src, open(filtered, "wb") as dst:
                dst.writelines(line for line in src if needle in line)
            spans = read_spans_jsonl(filtered)
        found = [s for s in spans if s.name == name and owner(s) >= 0]
        if len(found) >= len(req_ids) or time.monotonic() > deadline:
            return sorted(found, key=owner)
        time.sleep(0.5)


@pytest.mark.timeout(600)
def test_each_transfer_is_a_span_on_its_engine(
    producer: LLM,
    consumer: LLM,
    trace_root: str,
) -> None:
    """One send span per request on the producer (from its end to the reader's
    notification) and one load span per request on the consumer, with bytes,
    blocks, layers and milliseconds, written by each engine's process. (The
    request's trace continuing across engines needs a traced frontend, which
    these two engines sharing one test process do not have: the
    ExampleConnector's tests check that path, which kv_transfer_params share.)"""
    # Prompts neither engine has cached, so that every block is read.
    gen = torch.Generator().manual_seed(2)
    two = [torch.randint(5, 250, (n,), generator=gen).tolist() for n in (27, 50)]
    # Earlier tests left unread blocks held on the producer (until its timeout).
    held_before = _stats(producer)["used"]
    params = _prefill(producer, two)
    outputs = consumer.generate(_inputs(two), [_greedy(p) for p in params], use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [len(p) for p in two]
    deadline = time.monotonic() + 60
    while _stats(producer)["used"] != held_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _stats(producer)["used"] == held_before
    # K and V, 2 KV heads of 16, fp32, block_size tokens, 2 layers.
    bytes_per_block = 2 * 2 * 16 * 4 * BLOCK_SIZE * 2
    for role, name, direction, req_ids in (
        (
            "producer",
            "NixlConnector.save_kv_layer",
            "save",
            [p["remote_request_id"] for p in params],
        ),
        ("consumer", "NixlConnector.wait_for_layer_load", "load", [o.request_id for o in outputs]),
    ):
        # Mutation caught: no span recorded for a finished read.
        spans = _spans(os.path.join(trace_root, role), name, req_ids)
        assert len(spans) == 2, (direction, spans)
        for span, prompt in zip(spans, two, strict=True):
            attrs = span.attributes
            num_blocks = _cdiv(len(prompt), BLOCK_SIZE)
            assert attrs["tracevllm.kv_transfer.connector"] == "NixlConnector"
            assert attrs["tracevllm.kv_transfer.direction"] == direction
            assert attrs["tracevllm.kv_transfer.num_blocks"] == num_blocks
            assert attrs["tracevllm.kv_transfer.num_layers"] == 2
            assert attrs["tracevllm.kv_transfer.num_bytes"] == num_blocks * bytes_per_block
            assert attrs["tracevllm.kv_transfer.ms"] >= 0
            assert span.process_kind == "engine_core"


# ---------------------------------------------- the worker side, without engines
# NixlConnectorWorkers built directly, each with its own NIXL agent, side
# channel and KV tensors, in this process: the READs and notifications are
# real, and each test steps the workers itself.
WORKER_BLOCKS = 16
WORKER_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def _worker_config(role: str, **extra: Any) -> Any:
    from tracevllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "hidden_size": 32,
        "num_hidden_layers": 2,
    }
    return VllmConfig(
        ModelConfig(model="fake", hf_config=hf_config, max_model_len=64),
        CacheConfig(block_size=BLOCK_SIZE),
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector", kv_role=role, kv_connector_extra_config=extra
        ),
    )


class _Side:
    """One worker-side connector and its KV cache (random on a producer)."""

    def __init__(
        self, role: str, engine_id: str, seed: int | None = None, send_key: bool = True
    ) -> None:
        from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (
            NixlConnectorWorker,
        )

        self.port = _free_port()
        saved = os.environ.get("TRACEVLLM_NIXL_SIDE_CHANNEL_PORT")
        os.environ["TRACEVLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.port)
        try:
            self.worker = NixlConnectorWorker(_worker_config(role), engine_id)
        finally:
            if saved is None:
                os.environ.pop("TRACEVLLM_NIXL_SIDE_CHANNEL_PORT")
            else:
                os.environ["TRACEVLLM_NIXL_SIDE_CHANNEL_PORT"] = saved
        gen = torch.Generator().manual_seed(seed or 0)
        shape = (WORKER_BLOCKS, 2, BLOCK_SIZE, 2, 16)
        self.caches = {
            name: torch.rand(shape, generator=gen) if seed is not None else torch.zeros(shape)
            for name in WORKER_LAYERS
        }
        self.worker.register_kv_caches(self.caches)
        # A producer's scheduler sends its params key with every step's
        # metadata (send_key=False: before its first step).
        self.params_key = os.urandom(32)
        if role != "kv_consumer" and send_key:
            self.send_key()

    def send_key(self, params_key: bytes | None = None) -> None:
        """A step's metadata brings the producer's worker its params key."""
        from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata,
        )

        self.params_key = params_key or self.params_key
        meta = NixlConnectorMetadata()
        meta.params_key = self.params_key
        self.worker.start_load_kv(meta)

    def blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        return [self.caches[name][block_ids].clone() for name in WORKER_LAYERS]

    def hold(self, req_id: str, token: str) -> None:
        """The producer's scheduler has finished req_id, holding its blocks."""
        from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata,
            SendMeta,
        )

        meta = NixlConnectorMetadata()
        meta.reqs_to_send[req_id] = time.perf_counter() + 300
        meta.send_meta[req_id] = SendMeta(num_blocks=2, num_tokens=16, notif_token=token)
        self.worker.start_load_kv(meta)

    def read(self, req_id: str, producer: _Side, *args: Any, **kwargs: Any) -> None:
        """The consumer's scheduler asks its worker to read a request's blocks
        (the arguments are req_meta's)."""
        from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata,
        )

        meta = NixlConnectorMetadata()
        meta.reqs_to_recv[req_id] = self.req_meta(req_id, producer, *args, **kwargs)
        self.worker.start_load_kv(meta)

    @staticmethod
    def req_meta(
        req_id: str,
        producer: _Side,
        local: list[int],
        remote: list[int],
        token: str,
        expires_in: float = 300.0,
        engine_id: str = "P",
        signed_expires_in: float | None = None,
        forged: bool = False,
    ) -> Any:
        """One request's entry in a consumer's metadata, with the producer's MAC
        over it (over another expiry if signed_expires_in is given: a client's
        change; forged: any MAC)."""
        from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            RemoteMeta,
            ReqMeta,
            compute_params_mac,
        )

        now = time.time()
        expiration_time = now + expires_in
        signed = now + signed_expires_in if signed_expires_in is not None else expiration_time
        remote_req_id = f"remote-{req_id}"
        mac = compute_params_mac(producer.params_key, remote_req_id, remote, signed, token)
        return ReqMeta(
            local_block_ids=local,
            remote=RemoteMeta(
                block_ids=remote,
                host="localhost",
                port=producer.port,
                engine_id=engine_id,
                request_id=remote_req_id,
                expiration_time=expiration_time,
                notif_token=token,
                params_mac="0" * 64 if forged else mac,
            ),
        )

    def until_read(self, req_id: str, timeout: float = 60.0) -> set[int]:
        """Step until req_id's read is reported; the block ids marked invalid."""
        from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata,
        )

        invalid: set[int] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.worker.start_load_kv(NixlConnectorMetadata())
            _, recving = self.worker.get_finished()
            invalid |= self.worker.get_block_ids_with_load_errors()
            if req_id in recving:
                return invalid
            time.sleep(0.05)
        raise AssertionError(f"{req_id}'s read never ended")

    def until_all_read(self, req_ids: set[str], timeout: float = 60.0) -> set[int]:
        """Step until every one of req_ids is reported; the block ids marked invalid."""
        from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata,
        )

        invalid: set[int] = set()
        pending = set(req_ids)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            self.worker.start_load_kv(NixlConnectorMetadata())
            _, recving = self.worker.get_finished()
            invalid |= self.worker.get_block_ids_with_load_errors()
            pending -= recving
            time.sleep(0.05)
        assert not pending, f"{pending}'s reads never ended"
        return invalid

    def until_sent(self, req_id: str, timeout: float = 30.0) -> bool:
        """Step until the producer frees req_id's blocks (False if it does not)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sending, _ = self.worker.get_finished()
            if req_id in sending:
                return True
            time.sleep(0.05)
        return False


@pytest.fixture(scope="module")
def sides() -> Iterator[tuple[_Side, _Side, _Side]]:
    """A producer (engine id "P"), a second producer that claims the same
    engine id at another address, and a consumer."""
    made: list[_Side] = []
    try:
        for role, engine_id, seed in (
            ("kv_producer", "P", 1),
            ("kv_producer", "P", 2),
            ("kv_consumer", "C", None),
        ):
            made.append(_Side(role, engine_id, seed))
        yield made[0], made[1], made[2]
    finally:
        for side in made:
            side.worker.shutdown()


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(300)
def test_worker_refuses_a_read_that_would_end_past_the_producers_expiry(
    sides: tuple[_Side, _Side, _Side], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer frees unread blocks at its expiry (and may reuse them):
    a read that would start, or is only seen to end, within kv_expiry_margin
    of it is a failed load, its blocks marked invalid, never trusted."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as nixl_worker

    producer, _, consumer = sides
    margin = consumer.worker.kv_expiry_margin
    assert margin == 10.0  # the default
    # A read well before the expiry: the producer's blocks arrive, and the
    # notification (with the request's token) frees them there.
    producer.hold("remote-ok", "tok1")
    consumer.read("ok", producer, [1, 2], [3, 4], "tok1")
    assert consumer.until_read("ok") == set()
    assert _same(consumer.blocks([1, 2]), producer.blocks([3, 4]))
    assert producer.until_sent("remote-ok")

    # Within the margin already: not read at all (mutation caught: the check
    # before posting removed -> the blocks are read).
    producer.hold("remote-soon", "tok2")
    consumer.read("soon", producer, [5, 6], [3, 4], "tok2", expires_in=margin / 2)
    assert consumer.until_read("soon") == {5, 6}
    assert not any(t.any() for t in consumer.blocks([5, 6]))

    # Posted in time, but seen done only past expiry - margin (the clock
    # moved on): failed, though the bytes came (mutation caught: the check
    # on completion removed -> reported as loaded).
    producer.hold("remote-late", "tok3")
    consumer.read("late", producer, [7, 8], [3, 4], "tok3")
    (handle,) = consumer.worker._recving_transfers["late"]  # posted
    deadline = time.monotonic() + 30
    while consumer.worker.nixl_wrapper.check_xfer_state(handle) != "DONE":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    monkeypatch.setattr(nixl_worker, "_wall_time", lambda: time.time() + 300)
    assert consumer.until_read("late") == {7, 8}
    assert _same(consumer.blocks([7, 8]), producer.blocks([3, 4]))

    # Still in progress when the expiry comes near: abandoned at once
    # (mutation caught: only kv_read_timeout bounds it -> still waiting).
    monkeypatch.undo()
    producer.hold("remote-slow", "tok7")
    consumer.read("slow", producer, [14, 15], [3, 4], "tok7")
    assert "slow" in consumer.worker._recving_transfers  # posted
    monkeypatch.setattr(consumer.worker.nixl_wrapper, "check_xfer_state", lambda h: "PROC")
    monkeypatch.setattr(nixl_worker, "_wall_time", lambda: time.time() + 300)
    _, recving = consumer.worker.get_finished()
    assert "slow" in recving
    assert consumer.worker.get_block_ids_with_load_errors() == {14, 15}


@pytest.mark.timeout(300)
def test_worker_refuses_params_the_producer_did_not_sign(
    sides: tuple[_Side, _Side, _Side],
) -> None:
    """The block ids, expiry and token come from the client; the producer's
    MAC over them (its key handed out on the side channel only) shows a
    change: a fresh expiry on old params is a failed load, not read (mutation
    caught: the MAC check removed -> the producer's blocks are read)."""
    producer, impostor, consumer = sides
    producer.hold("remote-forged", "tok9")
    consumer.read("forged", producer, [3, 4], [3, 4], "tok9", signed_expires_in=20)
    assert consumer.until_read("forged") == {3, 4}
    assert not any(t.any() for t in consumer.blocks([3, 4]))
    # Signed with another producer's key: refused too.
    impostor.params_key, producer.params_key = producer.params_key, impostor.params_key
    try:
        producer.hold("remote-other-key", "tok10")
        consumer.read("other-key", producer, [3, 4], [3, 4], "tok10")
        assert consumer.until_read("other-key") == {3, 4}
    finally:
        impostor.params_key, producer.params_key = producer.params_key, impostor.params_key
    assert not any(t.any() for t in consumer.blocks([3, 4]))


@pytest.mark.timeout(300)
def test_a_stale_or_empty_params_key_is_fetched_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer that handshakes before the producer's first step gets no
    params key: the read fails its MAC, but the next request to that producer
    handshakes again and reads. One that handshook before a producer's new key
    has the old one: the first read signed with the new key fetches the key
    again and, checked once more, reads; the agent is not added again
    (mutations caught: a handshake only for an unknown agent -> every later
    read fails, {1, 2} marked invalid; no refresh on a mismatch -> "stale"
    fails, {5, 6}; the agent added again on each such handshake)."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as nixl_worker

    monkeypatch.setattr(nixl_worker, "PARAMS_KEY_REFRESH_INTERVAL_S", 0.0)
    producer = _Side("kv_producer", "P3", seed=3, send_key=False)
    consumer = _Side("kv_consumer", "C4")
    try:
        producer.hold("remote-early", "tok11")
        consumer.read("early", producer, [1, 2], [3, 4], "tok11", engine_id="P3")
        assert consumer.until_read("early") == {1, 2}  # no key yet: not read
        producer.send_key()  # the producer's first step
        producer.hold("remote-later", "tok12")
        consumer.read("later", producer, [1, 2], [3, 4], "tok12", engine_id="P3")
        assert consumer.until_read("later") == set()
        assert _same(consumer.blocks([1, 2]), producer.blocks([3, 4]))
        assert producer.until_sent("remote-later")

        # A new key on the producer: the first read signed with it mismatches
        # the consumer's key (a stale key or a forged MAC), so the consumer
        # fetches the key again and reads it.
        added: list[bytes] = []
        wrapper = consumer.worker.nixl_wrapper
        real_add = wrapper.add_remote_agent

        def add_remote_agent(metadata: bytes) -> str:
            added.append(metadata)
            return real_add(metadata)

        wrapper.add_remote_agent = add_remote_agent  # this consumer is shut down below
        producer.send_key(os.urandom(32))
        for req_id, token, expected in (("stale", "tok13", set()), ("fresh", "tok14", set())):
            producer.hold(f"remote-{req_id}", token)
            consumer.read(req_id, producer, [5, 6], [7, 8], token, engine_id="P3")
            assert consumer.until_read(req_id) == expected, req_id
        assert _same(consumer.blocks([5, 6]), producer.blocks([7, 8]))
        assert producer.until_sent("remote-fresh")
        assert added == []  # the same agent: only its key was fetched again
    finally:
        consumer.worker.shutdown()
        producer.worker.shutdown()


@pytest.mark.timeout(300)
def test_a_forged_mac_fails_only_its_own_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client of the decode server can send well-formed params naming a real
    producer with any MAC. The consumer keeps the producer's key for every
    other request and checks only the mismatching one again, after fetching
    the key once more (at most every PARAMS_KEY_REFRESH_INTERVAL_S): an honest
    read queued behind a forged one in the same step loads, on a cold
    handshake and on a warm key alike (mutation caught: the key dropped at
    the mismatch -> the honest request's blocks marked invalid too,
    {1, 2, 5, 6})."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as nixl_worker
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    producer = _Side("kv_producer", "P5", seed=5)
    consumer = _Side("kv_consumer", "C5")
    handshakes: list[int] = []
    real_handshake = consumer.worker._nixl_handshake

    def counting_handshake(*args: Any) -> str:
        handshakes.append(1)
        return real_handshake(*args)

    consumer.worker._nixl_handshake = counting_handshake  # type: ignore[method-assign]

    def forged_then_honest(n: int) -> set[int]:
        bad, good = f"bad{n}", f"good{n}"
        producer.hold(f"remote-{good}", f"tokg{n}")
        meta = NixlConnectorMetadata()
        meta.reqs_to_recv[bad] = _Side.req_meta(
            bad, producer, [1, 2], [3, 4], f"tokb{n}", engine_id="P5", forged=True
        )
        meta.reqs_to_recv[good] = _Side.req_meta(
            good, producer, [5, 6], [7, 8], f"tokg{n}", engine_id="P5"
        )
        consumer.worker.start_load_kv(meta)
        invalid = consumer.until_all_read({bad, good})
        assert _same(consumer.blocks([5, 6]), producer.blocks([7, 8])), n
        assert producer.until_sent(f"remote-{good}"), n
        for cache in consumer.caches.values():  # so that the next round's read shows
            cache[5:7].zero_()
        return invalid

    # Rounds 0 and 1 must see the key as fresh however slow the machine is.
    monkeypatch.setattr(nixl_worker, "PARAMS_KEY_REFRESH_INTERVAL_S", 3600.0)
    try:
        # Cold: both wait on the first handshake; the key is fresh, so the
        # forged one fails at once, without another handshake.
        assert forged_then_honest(0) == {1, 2}
        assert len(handshakes) == 1
        # Warm, the key fetched just now: the same, no handshake.
        assert forged_then_honest(1) == {1, 2}
        assert len(handshakes) == 1
        # Warm, the key older than the interval: the forged one waits for the
        # key fetched again, mismatches it too and fails; the honest one is
        # read with the key kept meanwhile.
        monkeypatch.setattr(nixl_worker, "PARAMS_KEY_REFRESH_INTERVAL_S", 0.0)
        assert forged_then_honest(2) == {1, 2}
        assert len(handshakes) == 2
        assert consumer.worker._mac_rechecked == set()
    finally:
        consumer.worker.shutdown()
        producer.worker.shutdown()


@pytest.mark.timeout(300)
def test_a_failed_key_refresh_counts_toward_the_refresh_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A MAC mismatch fetches the producer's key again at most every
    PARAMS_KEY_REFRESH_INTERVAL_S, and an attempt whose handshake fails counts
    too: forged MACs naming a producer the consumer cannot reach again must
    not make it handshake at their rate (mutation caught: the time recorded
    only when a key arrives -> a handshake per forged request)."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as nixl_worker

    monkeypatch.setattr(nixl_worker, "PARAMS_KEY_REFRESH_INTERVAL_S", 3600.0)
    producer = _Side("kv_producer", "P6", seed=6)
    consumer = _Side("kv_consumer", "C6")
    try:
        producer.hold("remote-first", "tok61")
        consumer.read("first", producer, [1, 2], [3, 4], "tok61", engine_id="P6")
        assert consumer.until_read("first") == set()  # the key is fetched
        attempts: list[int] = []

        def unreachable(*args: Any) -> str:
            attempts.append(1)
            raise TimeoutError("the producer does not answer")

        consumer.worker._nixl_handshake = unreachable  # type: ignore[method-assign]
        # The key is older than the interval: the first forged MAC fetches it
        # again, which fails; the next ones fail at once.
        consumer.worker._params_key_fetched = {
            key: t - 7200 for key, t in consumer.worker._params_key_fetched.items()
        }
        for n in range(3):
            consumer.read(
                f"forged{n}", producer, [5, 6], [7, 8], f"tokf{n}", engine_id="P6", forged=True
            )
            assert consumer.until_read(f"forged{n}") == {5, 6}, n
        assert len(attempts) == 1
    finally:
        consumer.worker.shutdown()
        producer.worker.shutdown()


@pytest.mark.timeout(300)
def test_worker_abandons_a_read_stuck_in_progress(
    sides: tuple[_Side, _Side, _Side], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A READ that stays PROC (a hung peer) is released after kv_read_timeout
    and fails its request, so the scheduler gets its blocks back; a handle
    NIXL will not release yet is kept and tried again, since its READ could
    still write into them (mutation caught: no deadline -> never reported)."""
    producer, _, consumer = sides
    producer.hold("remote-hung", "tok4")
    consumer.read("ok-first", producer, [9], [3], "tok-unused")  # the handshake, if not yet
    consumer.until_read("ok-first")
    consumer.read("hung", producer, [10, 11], [3, 4], "tok4")
    assert "hung" in consumer.worker._recving_transfers  # posted
    wrapper = consumer.worker.nixl_wrapper
    real_release = wrapper.release_xfer_handle
    released: list[Any] = []

    def release_once_refused(handle: Any) -> None:
        released.append(handle)
        if len(released) == 1:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        real_release(handle)

    monkeypatch.setattr(wrapper, "check_xfer_state", lambda handle: "PROC")
    monkeypatch.setattr(wrapper, "release_xfer_handle", release_once_refused)
    monkeypatch.setattr(consumer.worker, "kv_read_timeout", 0.5)
    time.sleep(0.6)
    _, recving = consumer.worker.get_finished()
    # The release was refused: still waiting, nothing reported yet.
    assert len(released) == 1 and "hung" not in recving
    assert "hung" in consumer.worker._recving_transfers
    _, recving = consumer.worker.get_finished()
    assert len(released) == 2 and "hung" in recving
    assert consumer.worker.get_block_ids_with_load_errors() == {10, 11}
    assert "hung" not in consumer.worker._recving_transfers


@pytest.mark.timeout(300)
def test_remote_agents_are_keyed_by_address_not_engine_id(
    sides: tuple[_Side, _Side, _Side],
) -> None:
    """A side channel that answers with another engine's id stands in for
    it only at its own address: a later request naming the real producer's
    address reads the real producer's blocks (mutation caught: agents keyed
    by engine id alone -> the second read gets the impostor's bytes)."""
    producer, impostor, consumer = sides
    impostor.hold("remote-imp", "tok5")
    consumer.read("imp", impostor, [12], [3], "tok5")
    assert consumer.until_read("imp") == set()
    assert _same(consumer.blocks([12]), impostor.blocks([3]))
    producer.hold("remote-real", "tok6")
    consumer.read("real", producer, [13], [3], "tok6")
    assert consumer.until_read("real") == set()
    assert _same(consumer.blocks([13]), producer.blocks([3]))
    assert not _same(producer.blocks([3]), impostor.blocks([3]))


@pytest.mark.timeout(120)
def test_notifications_are_parsed_defensively_and_need_the_requests_token(
    sides: tuple[_Side, _Side, _Side], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone who can reach the producer's agent can notify it: a malformed
    notification is dropped (before: UnicodeDecodeError or ValueError inside
    the step), and one without the request's token frees nothing (mutation
    caught: the token not compared -> freed by a reader of another request)."""
    producer, _, _ = sides
    wrapper = producer.worker.nixl_wrapper
    pending: list[list[bytes]] = []
    monkeypatch.setattr(
        wrapper, "get_new_notifs", lambda: {"someone": pending.pop(0)} if pending else {}
    )
    producer.hold("held", "good")
    pending.append(
        [b"\xff\xfe", b"no colon", b"held:1", b"held:bad:1", b"held:g\xc3\xa9:1", b"x:good:1"]
    )
    sending, _ = producer.worker.get_finished()
    assert "held" not in sending and "held" in producer.worker._reqs_to_send
    pending.append([b"held:good:1"])
    sending, _ = producer.worker.get_finished()
    assert "held" in sending and "held" not in producer.worker._reqs_to_send
    # A notification before the producer's worker heard of the request is
    # matched with its token too...
    token = "0123456789abcdef" * 2  # the producer's form: 32 hex digits
    pending.append([b"early:" + b"f" * 32 + b":1", f"other:{token}:1".encode()])
    producer.worker.get_finished()
    producer.hold("early", token)
    assert "early" in producer.worker._reqs_to_send
    pending.append([f"early2:{token}:1".encode()])
    producer.worker.get_finished()
    producer.hold("early2", token)
    assert "early2" not in producer.worker._reqs_to_send
    # ...and reported by the next step, so that the scheduler frees its
    # blocks (before: never reported, held for good; mutation caught).
    sending, _ = producer.worker.get_finished()
    assert "early2" in sending
    sending, _ = producer.worker.get_finished()
    assert "early2" not in sending
    # An early notification for a request with a long id (a client's long
    # X-Request-Id) is kept as a fixed-size digest of the id and matched when
    # the request comes (before: over 4 KB it was dropped, and the request's
    # blocks stayed held until the timeout; mutations caught: the long one
    # dropped -> held; the id itself kept -> its bytes in _early_notifs)...
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import parse_notif

    assert parse_notif(f"r:{token}:1".encode()) == ("r", token)
    long_id = "x" * 100_000
    pending.append([f"{long_id}:{token}:1".encode()])
    producer.worker.get_finished()
    assert all(len(digest) == 32 for digest, _ in producer.worker._early_notifs)
    producer.hold(long_id, token)
    assert long_id not in producer.worker._reqs_to_send
    sending, _ = producer.worker.get_finished()
    assert long_id in sending
    # ...and a held request's is matched whatever its id's length, so that its
    # reader frees it (mutation caught: a bound in parse_notif -> its blocks
    # held until the abort timeout).
    long_held = "cmpl-" + "y" * 100_000 + "-0"
    producer.hold(long_held, token)
    pending.append([f"{long_held}:{token}:1".encode()])
    sending, _ = producer.worker.get_finished()
    assert long_held in sending and long_held not in producer.worker._reqs_to_send


def test_warnings_about_what_a_peer_sends_are_rate_limited(
    sides: tuple[_Side, _Side, _Side],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer can send wrong-token, unknown and malformed notifications as
    fast as it likes: each kind is logged once per interval, with the count
    of those left out (mutation caught: a warning per notification -> 200
    lines in the log)."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as nixl_worker

    producer, _, _ = sides
    worker = producer.worker
    pending: list[list[bytes]] = []
    monkeypatch.setattr(
        worker.nixl_wrapper, "get_new_notifs", lambda: {"a": pending.pop(0)} if pending else {}
    )
    monkeypatch.setattr(worker, "_peer_warnings", nixl_worker._PeerWarnings())  # earlier tests'
    producer.hold("held-w", "good")
    pending.append([b"held-w:bad:1", b"u:t:1", b"\xff"] * 200)
    with caplog.at_level(logging.WARNING):
        worker.get_finished()
    lines = [r.getMessage() for r in caplog.records if "NixlConnector" in r.getMessage()]
    assert len(lines) == 3, lines
    caplog.clear()
    monkeypatch.setattr(worker._peer_warnings, "interval", 0.0)
    pending.append([b"held-w:bad:1"])
    with caplog.at_level(logging.WARNING):
        worker.get_finished()
    (line,) = [r.getMessage() for r in caplog.records if "wrong token" in r.getMessage()]
    assert "and 199 more like it since the last" in line
    assert "held-w" in worker._reqs_to_send


@pytest.mark.timeout(120)
def test_the_side_channel_keeps_serving_after_malformed_messages(
    sides: tuple[_Side, _Side, _Side],
) -> None:
    """Anyone can connect to a producer's side channel: messages that are not
    a REQ's (2 or 4 frames at the ROUTER) or not msgpack are dropped, and a
    new consumer's handshake and read still work (before 30062d4 the first
    one ended the listener thread; mutations caught: the frame-count check
    removed, the msgpack decode error not caught -> the listener thread
    dies, and nothing answers)."""
    import zmq

    producer, _, _ = sides
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"tcp://localhost:{producer.port}")
    try:
        # The ROUTER sees the peer's identity frame first: 2 and 4 frames.
        sock.send_multipart([b"one frame"])
        sock.send_multipart([b"three", b"", b"frames"])
        # 3 frames, but not msgpack: answered empty. Its answer means the
        # listener has taken the two before it too (one peer, in order).
        sock.send_multipart([b"", b"\xc1 not msgpack"])
        assert sock.recv_multipart() == [b"", b""]
    finally:
        sock.close()
        ctx.term()
    fresh = _Side("kv_consumer", "C2")
    try:
        producer.hold("remote-after-junk", "tok8")
        fresh.read("after-junk", producer, [1, 2], [5, 6], "tok8")
        assert fresh.until_read("after-junk") == set()
        assert _same(fresh.blocks([1, 2]), producer.blocks([5, 6]))
        assert producer.until_sent("remote-after-junk")
    finally:
        fresh.worker.shutdown()


def test_shutdown_waits_for_a_handshake_in_flight() -> None:
    """Worker shutdown waits for the handshake thread's running task, so a
    late handshake cannot add a remote agent after they are all removed
    (mutation caught: shutdown(wait=False) -> returns while it runs)."""
    import threading

    side = _Side("kv_consumer", "C3")
    started, finished = threading.Event(), threading.Event()

    def slow_handshake() -> None:
        started.set()
        time.sleep(0.5)
        finished.set()

    side.worker._handshake_initiation_executor.submit(slow_handshake)
    assert started.wait(10)
    side.worker.shutdown()
    assert finished.is_set()


@pytest.mark.timeout(120)
def test_early_notifications_are_bounded_and_need_a_token_of_the_producers_form(
    sides: tuple[_Side, _Side, _Side], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Notifications for requests the producer has not heard of are kept until
    the request comes, but anyone who reaches its agent can send them: only
    tokens of the producer's form (32 hex digits) are kept (mutation caught:
    the form check removed -> "t" kept), and at most MAX_EARLY_NOTIFS, the
    oldest dropped (mutation caught: no cap -> 5 kept)."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as nixl_worker

    producer, _, _ = sides
    worker = producer.worker
    pending = [[b"x:t:1", b"y:" + b"A" * 32 + b":1", b"z:" + b"a" * 33 + b":1"]]
    monkeypatch.setattr(
        worker.nixl_wrapper, "get_new_notifs", lambda: {"a": pending.pop(0)} if pending else {}
    )
    monkeypatch.setattr(nixl_worker, "MAX_EARLY_NOTIFS", 3)
    monkeypatch.setattr(worker, "_early_notifs", {})
    token = "abcdef0123456789" * 2
    worker.get_finished()
    assert worker._early_notifs == {}
    pending.append([f"e{i}:{token}:1".encode() for i in range(5)])
    worker.get_finished()
    assert [digest for digest, _ in worker._early_notifs] == [
        nixl_worker.id_digest(f"e{i}") for i in (2, 3, 4)
    ]


def _remote_prefill_params(prompt: list[int]) -> dict[str, Any]:
    """Well-formed params for a remote prefill of prompt (no producer behind them)."""
    return {
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2, 3],
        "remote_engine_id": "P",
        "remote_request_id": "r",
        "remote_host": "localhost",
        "remote_port": 5600,
        "remote_num_tokens": len(prompt),
        "remote_expiration_time": time.time() + 300,
        "remote_notif_token": "abc123",
        "remote_params_mac": "0" * 64,
    }


def test_allowed_producers_and_the_new_kv_transfer_params_fields() -> None:
    """kv_connector_extra_config['allowed_producers'] limits the addresses a
    decode engine reads from (mutation caught: the check skipped); the
    producer's expiry and token must come with the params."""
    from tests.test_scheduler import make_request
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
        NixlConnectorScheduler,
        get_allowed_producers,
        remote_prefill_params_problem,
    )

    assert get_allowed_producers({}) is None
    assert get_allowed_producers({"allowed_producers": ["10.0.0.2:5600", "::1:5601"]}) == {
        ("10.0.0.2", 5600),
        ("::1", 5601),
    }
    for bad in ("h:5600", ["h"], ["h:0"], ["h:x"], [":5600"], [5600]):
        with pytest.raises(TypeError, match="allowed_producers"):
            get_allowed_producers({"allowed_producers": bad})
    for key, bad_seconds in (("kv_expiry_margin", "10"), ("kv_read_timeout", True)):
        with pytest.raises(TypeError, match=key):
            NixlConnectorScheduler(
                _worker_config("kv_consumer", **{key: bad_seconds}), "C", _kv_cache_config()
            )

    prompt = list(range(10, 34))
    good = _remote_prefill_params(prompt)
    assert remote_prefill_params_problem(good, len(prompt)) is None
    for key, value in (
        ("remote_expiration_time", None),
        ("remote_expiration_time", "soon"),
        ("remote_expiration_time", float("nan")),
        ("remote_notif_token", ""),
        ("remote_notif_token", "a:b"),
        ("remote_notif_token", "gé"),
        ("remote_notif_token", 7),
        ("remote_params_mac", None),
        ("remote_params_mac", "0" * 63),
        ("remote_params_mac", "A" * 64),
    ):
        assert remote_prefill_params_problem({**good, key: value}, len(prompt)), (key, value)

    scheduler = NixlConnectorScheduler(
        _worker_config("kv_consumer", allowed_producers=["localhost:5600"]),
        "C",
        _kv_cache_config(),
    )
    for port, expected in ((5600, (len(prompt), True)), (5601, (0, False))):
        params = {**good, "remote_port": port}
        request = make_request(f"r{port}", prompt, extra_args={"kv_transfer_params": params})
        assert scheduler.get_num_new_matched_tokens(request, 0) == expected, port
    assert request.kv_transfer_params is not None
    assert request.kv_transfer_params["do_remote_prefill"] is False  # refused: computed here


def test_only_a_consumer_reads_and_one_reading_from_anywhere_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine whose role is kv_producer ignores do_remote_prefill (it never
    needs to read, so a client cannot make it connect anywhere; mutation
    caught: the role check removed -> (24, True)), kv_both still reads, and a
    kv_consumer without allowed_producers warns once at start-up (mutation
    caught: the warning removed)."""
    from tests.test_scheduler import make_request
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
        NixlConnectorScheduler,
    )

    prompt = list(range(10, 34))
    params = _remote_prefill_params(prompt)
    for role, expected in (("kv_producer", (0, False)), ("kv_both", (len(prompt), True))):
        scheduler = NixlConnectorScheduler(_worker_config(role), "E", _kv_cache_config())
        request = make_request(role, prompt, extra_args={"kv_transfer_params": dict(params)})
        with caplog.at_level("WARNING"):
            assert scheduler.get_num_new_matched_tokens(request, 0) == expected, role
        assert request.kv_transfer_params is not None
        assert request.kv_transfer_params["do_remote_prefill"] is (role == "kv_both")
    assert "kv_role is kv_producer" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        NixlConnectorScheduler(_worker_config("kv_producer"), "P", _kv_cache_config())
        assert "allowed_producers" not in caplog.text
        NixlConnectorScheduler(
            _worker_config("kv_consumer", allowed_producers=["localhost:5600"]),
            "C",
            _kv_cache_config(),
        )
        assert "allowed_producers" not in caplog.text
        NixlConnectorScheduler(_worker_config("kv_consumer"), "C", _kv_cache_config())
        assert caplog.text.count("allowed_producers") == 1


def test_an_aborted_remote_prefill_is_checked_before_its_producer_is_notified(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request aborted before the scheduler looked at its params (added and
    aborted in one input drain, or its client gone while it waited) still
    notifies its producer, so that the producer's blocks are freed, but only
    on a consumer and for params that pass get_num_new_matched_tokens's
    checks. Before, do_remote_prefill alone made build_connector_meta raise
    KeyError inside Scheduler.schedule() (the engine core died), and
    well-formed params made a kv_producer, or a consumer with
    allowed_producers, connect wherever they said (mutation caught:
    request_finished queuing the notification unchecked -> KeyError
    'remote_block_ids', then the producer's and the listed consumer's
    reqs_to_recv hold the request)."""
    from tests.test_scheduler import make_request
    from tracevllm.core.sched.scheduler import Scheduler
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
        NixlConnectorScheduler,
    )
    from tracevllm.request import RequestStatus

    prompt = list(range(10, 34))

    def aborted(req_id: str, params: dict[str, Any]) -> Any:
        request = make_request(req_id, prompt, extra_args={"kv_transfer_params": dict(params)})
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    # As the engine core runs it: added, aborted, then the next step.
    config = _worker_config("kv_consumer")
    config.cache_config.num_gpu_blocks = WORKER_BLOCKS
    scheduler = Scheduler(config)
    request = make_request(
        "bare", prompt, extra_args={"kv_transfer_params": {"do_remote_prefill": True}}
    )
    scheduler.add_request(request)
    scheduler.finish_requests("bare", RequestStatus.FINISHED_ABORTED)
    output = scheduler.schedule()
    assert output.kv_connector_metadata.reqs_to_recv == {}
    assert request.kv_transfer_params == {"do_remote_prefill": False}

    good = _remote_prefill_params(prompt)
    evil = {**good, "remote_host": "evil.example", "remote_port": 1}
    for role, extra, params in (
        ("kv_producer", {}, good),
        ("kv_consumer", {"allowed_producers": ["localhost:5600"]}, evil),
        ("kv_consumer", {}, {**good, "remote_expiration_time": None}),
    ):
        connector = NixlConnectorScheduler(_worker_config(role, **extra), "E", _kv_cache_config())
        request = aborted("a", params)
        with caplog.at_level("WARNING"):
            assert connector.request_finished(request, []) == (False, None)
        assert connector._reqs_need_recv == {}, (role, params)  # not queued at all
        assert connector.build_connector_meta(output).reqs_to_recv == {}, (role, params)
        assert request.kv_transfer_params is not None
        assert request.kv_transfer_params["do_remote_prefill"] is False
    assert "the producer is not notified" in caplog.text
    # Params that pass: the producer is still told (nothing to read).
    connector = NixlConnectorScheduler(
        _worker_config("kv_consumer", allowed_producers=["localhost:5600"]),
        "C",
        _kv_cache_config(),
    )
    connector.request_finished(aborted("ok", good), [])
    (meta,) = connector.build_connector_meta(output).reqs_to_recv.values()
    assert meta.local_block_ids == [] and meta.remote.port == 5600

    # And whatever else queues a read, build_connector_meta checks the params
    # again: update_state_after_alloc called for params that were never
    # checked (mutation caught: that check removed -> KeyError
    # 'remote_expiration_time').
    unchecked = {k: v for k, v in good.items() if k != "remote_expiration_time"}
    request = make_request("u", prompt, extra_args={"kv_transfer_params": unchecked})
    connector.update_state_after_alloc(request, None, 0)  # type: ignore[arg-type]
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert connector.build_connector_meta(output).reqs_to_recv == {}
    assert "remote_expiration_time" in caplog.text


def test_a_parked_request_whose_params_fail_the_second_check_is_a_failed_load(
    sides: tuple[_Side, _Side, _Side], caplog: pytest.LogCaptureFixture
) -> None:
    """build_connector_meta checks every queued read's params again. A request
    already parked for remote KV (local blocks allocated) whose params fail
    there is reported by the worker as a failed load, its blocks invalid, so
    the scheduler recomputes (or fails) it, rather than waiting for good
    (mutation caught: skipped silently, as before -> reqs_to_fail empty, and
    nothing reported)."""
    from types import SimpleNamespace

    from tests.test_scheduler import make_request
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
        NixlConnectorScheduler,
    )

    prompt = list(range(10, 34))
    connector = NixlConnectorScheduler(_worker_config("kv_consumer"), "C", _kv_cache_config())
    unchecked = _remote_prefill_params(prompt)
    del unchecked["remote_expiration_time"]
    request = make_request("parked", prompt, extra_args={"kv_transfer_params": unchecked})
    blocks = SimpleNamespace(get_unhashed_block_ids=lambda: [9, 10])
    connector.update_state_after_alloc(request, blocks, len(prompt))  # type: ignore[arg-type]
    with caplog.at_level("ERROR"):
        meta = connector.build_connector_meta(None)  # type: ignore[arg-type]
    assert meta.reqs_to_recv == {} and meta.reqs_to_fail == {"parked": [9, 10]}
    assert "reported as a failed load" in caplog.text
    _, _, consumer = sides
    consumer.worker.start_load_kv(meta)
    _, recving = consumer.worker.get_finished()
    assert "parked" in recving
    assert consumer.worker.get_block_ids_with_load_errors() == {9, 10}


def _kv_cache_config(num_blocks: int = WORKER_BLOCKS) -> Any:
    """A pool of num_blocks for a scheduler-side connector (no tensors)."""
    from tracevllm.kv_cache_interface import KVCacheConfig

    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[])


def _finish_for_remote_decode(
    scheduler: Any, req_id: str, block_ids: list[int], num_output_tokens: int = 0
) -> Any:
    """A producer's request sent with do_remote_decode, finished after
    num_output_tokens tokens: request_finished's answer."""
    from tests.test_scheduler import make_request
    from tracevllm.request import RequestStatus

    prompt = list(range(10, 10 + BLOCK_SIZE * len(block_ids)))
    request = make_request(
        req_id,
        prompt,
        max_tokens=max(num_output_tokens, 1),
        extra_args={"kv_transfer_params": {"do_remote_decode": True}},
    )
    for token in range(num_output_tokens):
        request.append_output_token_ids(token)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.num_computed_tokens = len(prompt) + max(num_output_tokens - 1, 0)
    return scheduler.request_finished(request, block_ids)


def test_a_producer_holds_at_most_max_held_fraction_of_its_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Any client can ask a producer to hold a finished request's blocks (for
    480 s, unless its reader notifies): past max_held_fraction of the pool
    (tracevllm's; vLLM has no cap) a request's blocks are freed at once and
    it gets no kv_transfer_params, and blocks read (or expired) make room
    again (mutation caught: the cap check removed -> a third request held,
    12 of 16 blocks pinned)."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
        NixlConnectorScheduler,
        get_max_held_fraction,
    )
    from tracevllm.outputs import KVConnectorOutput

    assert get_max_held_fraction({}) == 0.5
    for bad in (-0.1, 1.5, "0.5", True, float("nan")):
        with pytest.raises(TypeError, match="max_held_fraction"):
            get_max_held_fraction({"max_held_fraction": bad})
    scheduler = NixlConnectorScheduler(_worker_config("kv_producer"), "P", _kv_cache_config(16))
    assert scheduler.max_held_blocks == 8
    assert _finish_for_remote_decode(scheduler, "a", [1, 2, 3, 4])[0] is True
    held, params = _finish_for_remote_decode(scheduler, "b", [5, 6, 7, 8])
    assert held is True and params is not None  # 8 of 16: at the cap, not past it
    with caplog.at_level("WARNING"):
        assert _finish_for_remote_decode(scheduler, "c", [9, 10, 11, 12]) == (False, None)
    assert "max_held_fraction" in caplog.text
    # The reader of "a" is done (or its hold expired): room for "c" again.
    scheduler.update_connector_output(KVConnectorOutput(finished_sending={"a"}))
    assert _finish_for_remote_decode(scheduler, "c", [9, 10, 11, 12])[0] is True
    # 0 holds nothing: every request computes its prompt on its reader.
    none_held = NixlConnectorScheduler(
        _worker_config("kv_producer", max_held_fraction=0), "P", _kv_cache_config(16)
    )
    assert _finish_for_remote_decode(none_held, "d", [1]) == (False, None)


def test_max_held_fraction_counts_a_shared_prefix_once() -> None:
    """Requests that share a prefix (a common system prompt) hold its blocks
    once: the cap counts distinct held blocks, and a block stays counted until
    the last request holding it is done (mutations caught: the sum of each
    request's blocks -> "b" refused, 8 > 6; a block uncounted when the first
    of its holders is done -> "d" held while 7 distinct blocks are)."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
        NixlConnectorScheduler,
    )
    from tracevllm.outputs import KVConnectorOutput

    scheduler = NixlConnectorScheduler(_worker_config("kv_producer"), "P", _kv_cache_config(12))
    assert scheduler.max_held_blocks == 6
    assert _finish_for_remote_decode(scheduler, "a", [1, 2, 3, 4])[0] is True
    assert _finish_for_remote_decode(scheduler, "b", [1, 2, 3, 4])[0] is True  # 4 distinct
    assert _finish_for_remote_decode(scheduler, "c", [1, 2, 5, 6])[0] is True  # 6
    assert _finish_for_remote_decode(scheduler, "d", [7]) == (False, None)  # 7 > 6
    # "a" is read: "b" and "c" still hold its blocks.
    scheduler.update_connector_output(KVConnectorOutput(finished_sending={"a"}))
    assert _finish_for_remote_decode(scheduler, "d", [7]) == (False, None)
    # "b" is read: blocks 3 and 4 are held by no one now.
    scheduler.update_connector_output(KVConnectorOutput(finished_sending={"b"}))
    assert _finish_for_remote_decode(scheduler, "d", [7])[0] is True  # 5
    assert _finish_for_remote_decode(scheduler, "e", [5, 8])[0] is True  # 6: 5 is held already
    assert _finish_for_remote_decode(scheduler, "f", [9]) == (False, None)


def test_only_a_producer_holds_and_only_for_a_prefill(caplog: pytest.LogCaptureFixture) -> None:
    """Any client can send do_remote_decode. A kv_consumer serves no side
    channel, so nothing could read what it held (mutation caught: no role
    check -> held 8 minutes, params returned); a request that generated more
    than one token (a completion on a kv_both server, which the OpenAI
    server's one-token rule does not cover) has params no reader accepts
    (remote_num_tokens is not the prompt's), so its blocks are freed at once
    with one warning (mutation caught: no length check -> held, with params)."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
        NixlConnectorScheduler,
    )

    def scheduler(role: str) -> Any:
        return NixlConnectorScheduler(_worker_config(role), "E", _kv_cache_config(16))

    consumer = scheduler("kv_consumer")
    with caplog.at_level("WARNING"):
        assert _finish_for_remote_decode(consumer, "a", [1, 2]) == (False, None)
    assert consumer._held_block_refs == {} and consumer._reqs_need_send == {}
    assert "kv_consumer" in caplog.text
    for role in ("kv_both", "kv_producer"):
        producer = scheduler(role)
        caplog.clear()
        with caplog.at_level("WARNING"):
            long = _finish_for_remote_decode(producer, "long", [1, 2], num_output_tokens=8)
        assert long == (False, None), role
        assert producer._held_block_refs == {} and producer._reqs_need_send == {}, role
        assert caplog.text.count("generated 8 tokens") == 1, role
        held, params = _finish_for_remote_decode(producer, "one", [1, 2], num_output_tokens=1)
        assert held is True and params is not None, role
        assert params["remote_num_tokens"] == 2 * BLOCK_SIZE  # the prompt's


def test_held_blocks_count_each_block_once_and_not_the_null_block() -> None:
    """A sliding-window group's block table holds the null block (id 0) once
    per block outside the window: a hold counts each distinct block once and
    the null block not at all, and a read leaves nothing counted (mutation
    caught: the list stored, one decrement per entry -> {0: -2} left, and
    {0: 1, 5: 1} counted while held)."""
    from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
        NixlConnectorScheduler,
    )
    from tracevllm.outputs import KVConnectorOutput

    scheduler = NixlConnectorScheduler(_worker_config("kv_producer"), "P", _kv_cache_config(16))
    assert _finish_for_remote_decode(scheduler, "a", [0, 0, 0, 5])[0] is True
    assert _finish_for_remote_decode(scheduler, "b", [0, 0, 5, 6, 6])[0] is True
    assert scheduler._held_block_refs == {5: 2, 6: 1}
    scheduler.update_connector_output(KVConnectorOutput(finished_sending={"a"}))
    assert scheduler._held_block_refs == {5: 1, 6: 1}
    scheduler.update_connector_output(KVConnectorOutput(finished_sending={"b", "a"}))
    assert scheduler._held_block_refs == {} and scheduler._held_blocks == {}


def test_worker_shutdown_shuts_the_processs_kv_connector_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a worker process only Worker.shutdown can shut the connector down
    (vLLM's: ensure_kv_transfer_shutdown); before, it went with the process,
    its NIXL agent and side channel never released."""
    from tracevllm.distributed.kv_transfer import kv_transfer_state
    from tracevllm.worker.worker import Worker

    closed: list[str] = []

    class Connector:
        def __init__(self, vllm_config: object) -> None:
            self._vllm_config = vllm_config

        def shutdown(self) -> None:
            closed.append("connector")

    # Another in-process engine's connector (not made from this worker's
    # config) stays up: the worker shuts down only its own. (Mutation
    # caught: the config check dropped -> the other engine's closed.)
    others = Connector(object())
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", others)
    worker = Worker.__new__(Worker)
    worker.model_runner = None
    worker.num_threads_at_init = None  # no init_device: no thread count to give back
    worker.vllm_config = object()  # type: ignore[assignment]
    worker.shutdown()
    assert closed == [] and kv_transfer_state.get_kv_transfer_group() is others
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", Connector(worker.vllm_config))
    worker.shutdown()
    assert closed == ["connector"] and not kv_transfer_state.has_kv_transfer_group()


def test_engine_core_shutdown_runs_every_step_when_the_executors_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler's and the worker's connectors are shut down even when the
    executor's shutdown raises; its error is raised after (before: only
    gc.unfreeze ran)."""
    from types import SimpleNamespace

    from tracevllm.distributed.kv_transfer import kv_transfer_state
    from tracevllm.engine.core import EngineCore

    done: list[str] = []

    class Connector:
        def __init__(self, vllm_config: object) -> None:
            self._vllm_config = vllm_config

        def shutdown(self) -> None:
            done.append("worker connector")

    def executor_shutdown() -> None:
        raise RuntimeError("executor shutdown failed")

    core = EngineCore.__new__(EngineCore)
    core.structured_output_manager = SimpleNamespace(clear_backend=lambda: None)  # type: ignore[assignment]
    core.model_executor = SimpleNamespace(shutdown=executor_shutdown)  # type: ignore[assignment]
    core.scheduler = SimpleNamespace(shutdown=lambda: done.append("scheduler"))  # type: ignore[assignment]
    core.vllm_config = SimpleNamespace(kv_transfer_config=object())  # type: ignore[assignment]
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", Connector(core.vllm_config))
    with pytest.raises(RuntimeError, match="executor shutdown failed"):
        core.shutdown()
    assert done == ["scheduler", "worker connector"]
