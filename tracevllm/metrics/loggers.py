"""Stat loggers: what the engine's stats become for people and for Prometheus.

Mirrors vllm/v1/metrics/loggers.py (``StatLoggerBase``,
``PrometheusStatLogger``): each batch of engine outputs brings the core's
``SchedulerStats`` and the frontend's ``IterationStats``; the Prometheus
logger turns them into vLLM's metrics, under vLLM's names (``vllm:*``) and
labels (``model_name``, ``engine``), so a dashboard made for vLLM reads a
tracevllm server; with speculative decoding, vLLM's spec-decode counters
(vllm/v1/spec_decode/metrics.py, ``SpecDecodingProm``). With a KV connector,
vLLM's external prefix-cache counters (``vllm:external_prefix_cache_queries``
and ``_hits``: prompt tokens asked of the connector after the local hit, and
those it had). Every family is vLLM's, with its type, buckets and labels.
Left out: the periodic log line (``LoggingStatLogger``), and the families
tracevllm has nothing to feed: the connectors' own (``KVConnectorPrometheus``:
``kv_connector_stats`` reach the logger, unread), LoRA, multimodal cache,
KV-block lifetime, sleep state, corrupted requests, waiting-by-reason,
config info.
Each logger has its own registry (vLLM uses the global one), so that several
can live in one process. Departure: ``finished_reason="abort"`` counts the
requests whose client hung up (vLLM 0.22.0 never counts them, see
``metrics/stats.py``); one that ends before its prefill (aborted while
waiting) is left out of the prompt-token and phase-time histograms, which
would count a prompt it never computed.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tracevllm.engine import FINISH_REASON_STRINGS
from tracevllm.metrics.stats import IterationStats, PromptTokenStats, SchedulerStats

# No *_created series beside each counter and histogram (as vLLM).
prometheus_client.disable_created_metrics()

# vLLM's buckets (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                           30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                           7680.0]  # fmt: skip
# Tokens in one engine step; the n parameter.
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_PARAM_BUCKETS = [1, 2, 5, 10, 20]


def build_buckets(mantissa_lst: list[int], max_value: int) -> list[int]:
    """``m * 10**e`` for each mantissa and e = 0, 1, ... while <= max_value."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for m in mantissa_lst:
            if m * 10**exponent > max_value:
                return buckets
            buckets.append(m * 10**exponent)
        exponent += 1


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """``build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]`` (vLLM's token-count buckets)."""
    return build_buckets([1, 2, 5], max_value)


class StatLoggerBase:
    """Takes each batch's stats (the output handler calls ``record``)."""

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        raise NotImplementedError


class PrometheusStatLogger(StatLoggerBase):
    """vLLM's Prometheus metrics, fed from SchedulerStats and IterationStats."""

    def __init__(
        self,
        model_name: str,
        engine_index: int = 0,
        num_speculative_tokens: int = 0,
        max_model_len: int = 8192,
    ) -> None:
        """``max_model_len`` bounds the token-count buckets, as in vLLM (the
        default is the default model's)."""
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": str(engine_index)}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: list[float] | list[int]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(
                **labels
            )

        self.gauge_scheduler_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.gauge_scheduler_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.gauge_kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.counter_prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.counter_prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.counter_connector_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.counter_connector_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        self.counter_num_preempted_reqs = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.counter_prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*names, "source"],
            registry=self.registry,
        )
        self.counter_prompt_tokens_by_source = {
            source: by_source.labels(**labels, source=source)
            for source in PromptTokenStats.ALL_SOURCES
        }
        self.counter_prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.counter_generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=self.registry,
        )
        self.counter_request_success = {
            reason: request_success.labels(**labels, finished_reason=reason)
            for reason in FINISH_REASON_STRINGS
        }
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.histogram_num_prompt_tokens_request = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.histogram_num_generation_tokens_request = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.histogram_iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.histogram_max_num_generation_tokens_request = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.histogram_n_request = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_PARAM_BUCKETS
        )
        self.histogram_max_tokens_request = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.histogram_time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.histogram_inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.histogram_request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.histogram_e2e_time_request = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_queue_time_request = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_inference_time_request = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_prefill_time_request = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_decode_time_request = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_prefill_kv_computed_request = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )
        # Speculative decoding (vLLM's SpecDecodingProm): only when it is on.
        # Acceptance rate = accepted / draft tokens; mean acceptance length =
        # 1 + accepted / drafts.
        self.spec_decoding_enabled = num_speculative_tokens > 0
        if self.spec_decoding_enabled:
            # SpecDecodingStats field -> vllm:spec_decode_<field>.
            self.counters_spec_decode = {
                field: counter(f"vllm:spec_decode_{field}", doc)
                for field, doc in (
                    ("num_drafts", "Number of spec decoding drafts."),
                    ("num_draft_tokens", "Number of draft tokens."),
                    ("num_accepted_tokens", "Number of accepted tokens."),
                )
            }
            per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [*names, "position"],
                registry=self.registry,
            )
            self.counter_spec_decode_num_accepted_tokens_per_pos = [
                per_pos.labels(**labels, position=str(pos)) for pos in range(num_speculative_tokens)
            ]

    # --8<-- [start:prometheus_record]
    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        """One batch: the scheduler's gauges and counters, then this
        iteration's tokens and latencies, then each finished request's."""
        if scheduler_stats is not None:
            self.gauge_scheduler_running.set(scheduler_stats.num_running_reqs)
            self.gauge_scheduler_waiting.set(scheduler_stats.num_waiting_reqs)
            self.gauge_kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            self.counter_prefix_cache_queries.inc(scheduler_stats.prefix_cache_stats.queries)
            self.counter_prefix_cache_hits.inc(scheduler_stats.prefix_cache_stats.hits)
            if (connector_stats := scheduler_stats.connector_prefix_cache_stats) is not None:
                self.counter_connector_prefix_cache_queries.inc(connector_stats.queries)
                self.counter_connector_prefix_cache_hits.inc(connector_stats.hits)
            if (spec := scheduler_stats.spec_decoding_stats) and self.spec_decoding_enabled:
                for field, spec_counter in self.counters_spec_decode.items():
                    spec_counter.inc(getattr(spec, field))
                for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                    self.counter_spec_decode_num_accepted_tokens_per_pos[pos].inc(n)
        if iteration_stats is None:
            return
        self.counter_num_preempted_reqs.inc(iteration_stats.num_preempted_reqs)
        self.counter_prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        prompt_token_stats = iteration_stats.prompt_token_stats
        for source, source_counter in self.counter_prompt_tokens_by_source.items():
            source_counter.inc(prompt_token_stats.get_by_source(source))
        self.counter_prompt_tokens_cached.inc(prompt_token_stats.cached_tokens)
        self.counter_generation_tokens.inc(iteration_stats.num_generation_tokens)
        num_iteration_tokens = (
            iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
        )
        if num_iteration_tokens:  # not for the stats of aborts (AsyncLLM.abort): no engine step
            self.histogram_iteration_tokens.observe(num_iteration_tokens)
        for max_gen_tokens in iteration_stats.max_num_generation_tokens_iter:
            self.histogram_max_num_generation_tokens_request.observe(max_gen_tokens)
        for n_param in iteration_stats.n_params_iter:
            self.histogram_n_request.observe(n_param)
        for ttft in iteration_stats.time_to_first_tokens_iter:
            self.histogram_time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            self.histogram_inter_token_latency.observe(itl)
        for finished in iteration_stats.finished_requests:
            self.counter_request_success[str(finished.finish_reason)].inc()
            self.histogram_e2e_time_request.observe(finished.e2e_latency)
            self.histogram_num_generation_tokens_request.observe(finished.num_generation_tokens)
            if finished.max_tokens_param:
                self.histogram_max_tokens_request.observe(finished.max_tokens_param)
            if not finished.prefilled:
                # tracevllm: ended before its prefill (aborted while waiting):
                # no prompt token was computed, no phase reached.
                continue
            self.histogram_queue_time_request.observe(finished.queued_time)
            self.histogram_prefill_time_request.observe(finished.prefill_time)
            self.histogram_inference_time_request.observe(finished.inference_time)
            self.histogram_decode_time_request.observe(finished.decode_time)
            self.histogram_prefill_kv_computed_request.observe(
                finished.num_prompt_tokens - max(finished.num_cached_tokens, 0)
            )
            self.histogram_num_prompt_tokens_request.observe(finished.num_prompt_tokens)
            self.histogram_request_time_per_output_token.observe(
                finished.mean_time_per_output_token
            )

    # --8<-- [end:prometheus_record]

    def render(self) -> bytes:
        """The Prometheus text format (what GET /metrics returns)."""
        return generate_latest(self.registry)
