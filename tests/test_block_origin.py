"""Where a prompt's KV came from: the step view's split, its view, and vLLM's counters.

Real runs on a tiny random-weight Llama, traced: an ``ExampleConnector``
consumer whose prompt is part local prefix hit, part the producer's stored
KV, part computed; an ``OffloadingConnector`` engine whose evicted prefix
comes back from the offload tier. Each new request's step view says how
many tokens came from where, the step's span carries the connector's name
and tokens, and the step panel draws the prompt's blocks by origin. Then
vLLM's ``connector_prefix_cache_stats`` from a scheduler with a connector,
and the Prometheus counters they feed.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import pytest
import torch
from rich.console import Console

from tests.test_kv_connector import _async_scheduler, _remote, _report
from tests.test_scheduler import make_request
from tests.utils import make_tiny_llama
from tracevllm import LLM, SamplingParams
from tracevllm.metrics.loggers import PrometheusStatLogger
from tracevllm.metrics.stats import PrefixCacheStats, SchedulerStats
from tracevllm.tracing import SPANS_FILE
from tracevllm.tracing.exporters import SpanRecord, read_spans_jsonl
from tracevllm.views.block_origin import block_letters
from tracevllm.views.report import render_report
from tracevllm.views.step import render_step

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("origin-tiny-llama")), seed=0)


def _tokens(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(5, 250, (n,), generator=gen).tolist()


def _llm(model_dir: str, **kwargs: Any) -> LLM:
    return LLM(
        model=model_dir,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=kwargs.pop("num_gpu_blocks_override", 64),
        max_model_len=160,
        enable_multiprocessing=False,
        **kwargs,
    )


def _generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _new_requests(spans: list[SpanRecord]) -> dict[int, tuple[SpanRecord, dict, dict]]:
    """Prompt length -> (its schedule span, its step view, its row) for every
    request admitted in a traced step."""
    found = {}
    for span in spans:
        if span.name == "Scheduler.schedule" and "tracevllm.view.step" in span.attributes:
            view = json.loads(span.attributes["tracevllm.view.step"])
            for req in view["requests"]:
                if req["kind"] == "new":
                    found[req["num_prompt_tokens"]] = (span, view, req)
    return found


def _text(renderable: Any) -> str:
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


@pytest.mark.timeout(300)
def test_a_consumers_prompt_is_drawn_as_prefix_hit_remote_and_computed(
    model_dir: str, tmp_path: Any
) -> None:
    """The consumer first computes a prompt sharing A's first 2 blocks, so
    A then hits those locally, loads the producer's next 3 (ExampleConnector
    stores the full blocks before the last token: 40 of 45) and computes its
    last 5 tokens."""
    gen = torch.Generator().manual_seed(0)
    a = _tokens(45, gen)
    x = a[:16] + _tokens(10, gen)  # 26 tokens, no stored KV
    store = str(tmp_path / "store")
    kv = {"kv_connector": "ExampleConnector", "kv_connector_extra_config":
          {"shared_storage_path": store}}  # fmt: skip
    with _llm(model_dir, kv_transfer_config={**kv, "kv_role": "kv_producer"}) as producer:
        _generate(producer, [a])
    trace_dir = str(tmp_path / "trace")
    with _llm(
        model_dir,
        kv_transfer_config={**kv, "kv_role": "kv_consumer"},
        trace_detail="request",
        trace_dir=trace_dir,
    ) as consumer:
        [out_x] = _generate(consumer, [x])
        [out_a] = _generate(consumer, [a])
    assert (out_x.num_cached_tokens, out_a.num_cached_tokens) == (0, 40)
    spans = read_spans_jsonl(os.path.join(trace_dir, SPANS_FILE))
    new = _new_requests(spans)
    span_x, view_x, row_x = new[26]
    span_a, view_a, row_a = new[45]
    assert view_a["kv_connector"] == "ExampleConnector"
    assert (row_x["num_local_cached_tokens"], row_x["num_external_cached_tokens"]) == (0, 0)
    assert (row_a["num_local_cached_tokens"], row_a["num_external_cached_tokens"]) == (16, 24)
    attrs = span_a.attributes
    assert attrs["tracevllm.kv_connector.name"] == "ExampleConnector"
    assert attrs["tracevllm.kv_connector.hit_tokens"] == 24
    assert attrs["tracevllm.prefix_cache.hit_tokens"] == 16  # the local hit alone
    assert span_x.attributes["tracevllm.kv_connector.hit_tokens"] == 0
    # The step panel: A's 6 blocks, 2 hit, 3 remote, the last (5 tokens) computed.
    text = _text(render_step(view_a))
    assert "Prompt KV by origin · ExampleConnector" in text
    row = next(line for line in text.splitlines() if "HH" in line)
    assert "HHRRRC" in row and "prefix hit 16 · remote 24 · computed 5" in row
    assert "CCCC" in _text(render_step(view_x))  # 26 tokens, all computed
    # The whole run's report draws it too.
    console = Console(width=160, record=True, file=io.StringIO())
    render_report(spans, console)
    assert console.export_text().count("Prompt KV by origin") == 2


@pytest.mark.timeout(300)
def test_an_evicted_prefix_is_drawn_as_loaded_from_the_offload_tier(
    model_dir: str, tmp_path: Any
) -> None:
    """A 20-block pool: two 100-token prompts evict a 64-token prefix, which
    the tier (room for everything) gives back to the next request with it."""
    gen = torch.Generator().manual_seed(0)
    prefix = _tokens(64, gen)
    rounds = [[prefix + _tokens(5, gen)], [_tokens(100, gen)], [_tokens(100, gen)],
              [prefix + _tokens(7, gen)]]  # fmt: skip
    with _llm(
        model_dir,
        num_gpu_blocks_override=20,
        kv_offloading_size=1 / 1024,
        trace_detail="request",
        trace_dir=str(tmp_path),
    ) as llm:
        cached = [_generate(llm, prompts)[0].num_cached_tokens for prompts in rounds]
    assert cached == [0, 0, 0, 64]
    _, view, row = _new_requests(read_spans_jsonl(str(tmp_path / SPANS_FILE)))[71]
    assert view["kv_connector"] == "OffloadingConnector"
    assert (row["num_local_cached_tokens"], row["num_external_cached_tokens"]) == (0, 64)
    text = _text(render_step(view))
    assert "OOOOOOOOC" in text and "offload tier 64 · computed 7" in text


def test_each_block_is_drawn_after_where_most_of_its_tokens_came_from() -> None:
    # A remote prompt of 17 tokens over blocks of 8, its last token computed
    # again: the last block holds that token alone.
    assert block_letters([("hit", 0), ("remote", 16), ("computed", 1)], 8) == [
        "remote", "remote", "computed"]  # fmt: skip
    # 4 remote and 4 computed in one block: a tie goes to the later source.
    assert block_letters([("hit", 8), ("remote", 4), ("computed", 12)], 8) == [
        "hit", "computed", "computed"]  # fmt: skip
    # Without a connector there is nothing to draw.
    view = {"requests": [{"req_id": "a", "num_local_cached_tokens": 8,
                          "num_external_cached_tokens": 0, "num_prompt_tokens": 9}],
            "block_size": 8, "kv_connector": None}  # fmt: skip
    from tracevllm.views.block_origin import render_block_origin

    assert render_block_origin(view) is None


def test_connector_prefix_cache_stats_count_what_the_connector_was_asked_and_had() -> None:
    """vLLM's SchedulerStats.connector_prefix_cache_stats: per request asked,
    the tokens past the local hit (queries) and those the connector had
    (hits), once, at admission; not again when a finished load runs."""
    sched = _async_scheduler()
    sched.add_request(_remote("a", list(range(100, 110)), do_remote_prefill=True))
    sched.add_request(make_request("b", list(range(200, 213)), max_tokens=4))
    so = sched.schedule()
    stats = _report(sched, so)[0].scheduler_stats
    assert stats is not None
    assert stats.connector_prefix_cache_stats == PrefixCacheStats(
        requests=2, queries=10 + 13, hits=10
    )
    assert stats.kv_connector_stats is None  # the fake connector keeps none
    # "a"'s load finished: it runs now, and is not asked (or counted) again.
    so = sched.schedule()
    stats = _report(sched, so, finished_recving={"a"})[0].scheduler_stats
    assert stats is not None and stats.connector_prefix_cache_stats == PrefixCacheStats()
    so = sched.schedule()
    assert "a" in so.num_scheduled_tokens
    stats = _report(sched, so)[0].scheduler_stats
    assert stats is not None and stats.connector_prefix_cache_stats == PrefixCacheStats()

    # The Prometheus counters they feed, under vLLM's names.
    logger = PrometheusStatLogger("m")
    for hits in (10, 5):
        logger.record(
            SchedulerStats(
                connector_prefix_cache_stats=PrefixCacheStats(requests=1, queries=16, hits=hits)
            ),
            None,
        )
    logger.record(SchedulerStats(), None)  # no connector: nothing to add
    text = logger.render().decode()
    assert 'vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 32.0' in text
    assert 'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 15.0' in text
