"""/metrics: vLLM's metric families, with vLLM's types, buckets and labels,
moved by real requests to a real ``tracevllm serve`` (the official ``openai``
client), aborted requests counted."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tracevllm.engine import FinishReason
from tracevllm.entrypoints.openai.server_process import ServerProcess, free_port
from tracevllm.metrics.loggers import PrometheusStatLogger, build_1_2_5_buckets
from tracevllm.metrics.stats import IterationStats, RequestStateStats

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512

# vLLM 0.22.0's families this change adds: name -> (type, le of the first buckets).
NEW_FAMILIES = {
    "vllm:iteration_tokens_total": ("histogram", [1, 8, 16, 32, 64]),
    "vllm:request_prompt_tokens": ("histogram", [1, 2, 5, 10, 20, 50, 100, 200, 500]),
    "vllm:request_generation_tokens": ("histogram", [1, 2, 5, 10, 20, 50, 100, 200, 500]),
    "vllm:request_max_num_generation_tokens": ("histogram", [1, 2, 5, 10, 20]),
    "vllm:request_params_n": ("histogram", [1, 2, 5, 10, 20]),
    "vllm:request_params_max_tokens": ("histogram", [1, 2, 5, 10, 20, 50, 100, 200, 500]),
    "vllm:request_inference_time_seconds": ("histogram", [0.3, 0.5, 0.8, 1.0]),
    "vllm:request_time_per_output_token_seconds": ("histogram", [0.01, 0.025, 0.05]),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", [1, 2, 5, 10]),
    "vllm:prompt_tokens_cached": ("counter", None),
    "vllm:prompt_tokens_by_source": ("counter", None),
}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """(family -> type, (sample name, labels less model_name/engine) -> value)."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            )
            samples[(s.name, labels)] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_buckets_and_families_are_vllms() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    logger = PrometheusStatLogger("m", max_model_len=MAX_MODEL_LEN)
    types, samples = parse(logger.render().decode())
    for name, (kind, first_buckets) in NEW_FAMILIES.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert types.get(family) == kind, name
        if first_buckets is not None:
            les = [float(le) for (n, labels) in samples if n == f"{name}_bucket"
                   for k, le in labels if k == "le" and le != "+Inf"]  # fmt: skip
            assert les[: len(first_buckets)] == first_buckets, name
            if name in ("vllm:request_prompt_tokens", "vllm:request_params_max_tokens"):
                assert max(les) == 500  # build_1_2_5_buckets(max_model_len)
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert value(samples, "vllm:prompt_tokens_by_source_total", source=source) == 0
    for reason in ("stop", "length", "abort", "error"):
        assert value(samples, "vllm:request_success_total", finished_reason=reason) == 0


def test_a_request_aborted_before_it_was_scheduled_has_no_negative_intervals() -> None:
    req = RequestStateStats(arrival_time=time.time() - 1.0, queued_ts=time.monotonic())
    stats = IterationStats()
    stats.update_from_finished_request(FinishReason.ABORT, "r", 7, 16, req)
    (finished,) = stats.finished_requests
    assert finished.finish_reason == FinishReason.ABORT
    assert finished.e2e_latency >= 1.0
    intervals = (finished.queued_time, finished.prefill_time, finished.inference_time,
                 finished.decode_time, finished.mean_time_per_output_token)  # fmt: skip
    assert intervals == (0, 0, 0, 0, 0)


def test_a_request_aborted_while_waiting_counts_no_prompt_work(tiny_model_dir: str) -> None:
    """A request aborted before its first token (waiting behind another:
    one sequence at a time) computed no prompt: it counts in
    ``request_success{abort}``, the end-to-end latency, the generated tokens
    (none) and its ``max_tokens``, not in ``request_prefill_kv_computed_tokens``
    or ``request_prompt_tokens`` (was: its whole prompt) nor the phase times.
    The running request, aborted after its first tokens, counts in all."""
    from tracevllm import SamplingParams
    from tracevllm.engine.arg_utils import EngineArgs
    from tracevllm.engine.async_llm import AsyncLLM

    logger = PrometheusStatLogger(MODEL, max_model_len=MAX_MODEL_LEN)
    running_prompt, waiting_prompt = "A long story about a cat", "Waiting in line " * 6

    async def run() -> tuple[int, int, int]:
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model=tiny_model_dir, max_num_seqs=1, num_gpu_blocks_override=64,
                       max_model_len=MAX_MODEL_LEN),
            stat_loggers=[logger],
        )  # fmt: skip
        try:
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            running = engine.generate(running_prompt, long, "running")
            first = await anext(running)  # it runs; the next one waits for its turn
            waiting_tokens: list[int] = []

            async def wait_in_line() -> None:
                async for out in engine.generate(waiting_prompt, long, "waiting"):
                    waiting_tokens.extend(out.outputs[0].token_ids)

            waiting = asyncio.create_task(wait_in_line())
            for _ in range(5):  # steps of the running request, the other sent and waiting
                out = await anext(running)
            waiting.cancel()  # a client that hangs up: AsyncLLM.generate aborts it
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await running.aclose()  # the running one, aborted the same way
            tokenizer = engine.get_tokenizer()
            assert len(out.outputs[0].token_ids) >= 5 and first.outputs[0].token_ids
            return (len(tokenizer(running_prompt).input_ids),
                    len(tokenizer(waiting_prompt).input_ids), len(waiting_tokens))  # fmt: skip
        finally:
            engine.shutdown()

    num_running_prompt, num_waiting_prompt, num_waiting_tokens = asyncio.run(run())
    assert num_waiting_tokens == 0 and num_waiting_prompt != num_running_prompt
    samples = parse(logger.render().decode())[1]
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 2
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_generation_tokens",
                 "vllm:request_params_max_tokens"):  # fmt: skip
        assert value(samples, f"{name}_count") == 2, name
    assert value(samples, "vllm:request_params_max_tokens_sum") == 800
    for name in ("vllm:request_prefill_kv_computed_tokens", "vllm:request_prompt_tokens"):
        assert value(samples, f"{name}_count") == 1, name
        assert value(samples, f"{name}_sum") == num_running_prompt, name
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds"):  # fmt: skip
        assert value(samples, f"{name}_count") == 1, name


# --- a real server ------------------------------------------------------------------
class Server(ServerProcess):
    def __init__(self, model_dir: str) -> None:
        port = free_port()
        super().__init__(
            [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", model_dir,
             "--port", str(port), "--served-model-name", MODEL, "--num-gpu-blocks-override", "256",
             "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
             "--uvicorn-log-level", "warning"],
            port,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
            timeout=120,
        )  # fmt: skip

    def samples(self) -> Samples:
        return parse(httpx.get(f"{self.url}/metrics").text)[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[Server]:
    with Server(tiny_model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def wait_idle(server: Server) -> Samples:
    deadline = time.monotonic() + 20
    while True:
        samples = server.samples()
        if value(samples, "vllm:num_requests_running") == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_new_families_move_with_real_requests(server: Server, client: openai.OpenAI) -> None:
    rng = random.Random(0)
    # (prompt token ids, max_tokens, n); ignore_eos: each child makes max_tokens tokens.
    requests = [([rng.randrange(100, 400) for _ in range(length)], max_tokens, n)
                for length, max_tokens, n in ((20, 5, 1), (37, 7, 1), (11, 3, 2))]  # fmt: skip
    before = server.samples()
    for prompt, max_tokens, n in requests:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, n=n, temperature=1.0, seed=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [len(c.text) > 0 for c in out.choices] == [True] * n
    after = server.samples()

    def d(name: str, **labels: str) -> float:
        return delta(after, before, name, **labels)

    # Per finished request (each of the n children is one, as in vLLM).
    children = [(len(p), m) for p, m, n in requests for _ in range(n)]
    assert d("vllm:request_prompt_tokens_count") == len(children) == 4
    assert d("vllm:request_prompt_tokens_sum") == sum(p for p, _ in children) == 20 + 37 + 22
    assert d("vllm:request_generation_tokens_sum") == sum(m for _, m in children) == 18
    assert d("vllm:request_params_max_tokens_sum") == 18
    assert d("vllm:request_params_max_tokens_count") == 4
    assert d("vllm:request_inference_time_seconds_count") == 4
    assert d("vllm:request_inference_time_seconds_sum") > 0
    assert d("vllm:request_time_per_output_token_seconds_count") == 4
    assert d("vllm:request_time_per_output_token_seconds_sum") > 0
    assert d("vllm:request_success_total", finished_reason="length") == 4
    # Per user request (all its children done): n and the longest child.
    assert d("vllm:request_params_n_count") == 3
    assert d("vllm:request_params_n_sum") == 1 + 1 + 2
    assert d("vllm:request_params_n_bucket", le="1.0") == 2
    assert d("vllm:request_max_num_generation_tokens_sum") == 5 + 7 + 3
    # Every token of every step, in some step's observation.
    assert d("vllm:iteration_tokens_total_sum") == (
        d("vllm:prompt_tokens_total") + d("vllm:generation_tokens_total")
    )
    assert d("vllm:iteration_tokens_total_count") >= 7  # at least the longest request's steps
    assert d("vllm:generation_tokens_total") == 18


def test_prompt_tokens_cached(server: Server, client: openai.OpenAI) -> None:
    prompt = [random.Random(1).randrange(100, 400) for _ in range(40)]
    before = server.samples()
    for _ in range(2):  # one after the other: the second finds two full blocks cached
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0.0)
    after = server.samples()
    cached = 2 * BLOCK_SIZE
    assert delta(after, before, "vllm:prompt_tokens_cached_total") == cached
    assert delta(after, before, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == (
        cached
    )
    assert delta(after, before, "vllm:prompt_tokens_by_source_total", source="local_compute") == (
        80 - cached
    )
    assert delta(after, before, "vllm:request_prefill_kv_computed_tokens_sum") == 80 - cached


def test_client_aborts_are_counted(server: Server, client: openai.OpenAI) -> None:
    """Clients that hang up mid-stream: request_success{finished_reason="abort"}
    counts each, as do the per-request histograms (vLLM 0.22.0 counts none)."""
    num_aborts = 6
    before = wait_idle(server)
    for i in range(num_aborts):
        with client.completions.create(
            model=MODEL, prompt=f"A long story {i}", max_tokens=400, stream=True,
            extra_body={"ignore_eos": True},
        ) as stream:  # fmt: skip
            for chunks, _ in enumerate(stream, 1):
                if chunks >= 3:
                    break  # leaving the block closes the connection
    deadline = time.monotonic() + 20
    while True:
        after = server.samples()
        aborted = delta(after, before, "vllm:request_success_total", finished_reason="abort")
        if aborted >= num_aborts or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert aborted == num_aborts
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 0
    assert delta(after, before, "vllm:e2e_request_latency_seconds_count") == num_aborts
    assert delta(after, before, "vllm:request_generation_tokens_count") == num_aborts
    assert 3 * num_aborts <= delta(after, before, "vllm:request_generation_tokens_sum") < 400
    assert delta(after, before, "vllm:request_params_n_count") == num_aborts
