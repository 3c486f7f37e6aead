"""Stat loggers: what the engine's stats become for people and for Prometheus.

Mirrors vllm/v1/metrics/loggers.py (``StatLoggerBase``,
``PrometheusStatLogger``): each batch of engine outputs brings the core's
``SchedulerStats`` and the frontend's ``IterationStats``; the Prometheus
logger turns them into vLLM's metrics, under vLLM's names (``vllm:*``) and
labels (``model_name``, ``engine``), so a dashboard made for vLLM reads a
tracevllm server; with speculative decoding, vLLM's spec-decode counters
(vllm/v1/spec_decode/metrics.py, ``SpecDecodingProm``). Left out: the
periodic log line (``LoggingStatLogger``), KV-connector, LoRA,
multimodal-cache and KV-block-lifetime metrics. Each logger has its own
registry (vLLM uses the global one), so that several can live in one process.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tracevllm.engine import FINISH_REASON_STRINGS
from tracevllm.metrics.stats import IterationStats, SchedulerStats

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


class StatLoggerBase:
    """Takes each batch's stats (the output handler calls ``record``)."""

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        raise NotImplementedError


class PrometheusStatLogger(StatLoggerBase):
    """vLLM's Prometheus metrics, fed from SchedulerStats and IterationStats."""

    def __init__(
        self, model_name: str, engine_index: int = 0, num_speculative_tokens: int = 0
    ) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": str(engine_index)}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
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
        self.counter_num_preempted_reqs = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.counter_prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
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
            if (spec := scheduler_stats.spec_decoding_stats) and self.spec_decoding_enabled:
                for field, spec_counter in self.counters_spec_decode.items():
                    spec_counter.inc(getattr(spec, field))
                for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                    self.counter_spec_decode_num_accepted_tokens_per_pos[pos].inc(n)
        if iteration_stats is None:
            return
        self.counter_num_preempted_reqs.inc(iteration_stats.num_preempted_reqs)
        self.counter_prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.counter_generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens_iter:
            self.histogram_time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            self.histogram_inter_token_latency.observe(itl)
        for finished in iteration_stats.finished_requests:
            self.counter_request_success[str(finished.finish_reason)].inc()
            self.histogram_e2e_time_request.observe(finished.e2e_latency)
            self.histogram_queue_time_request.observe(finished.queued_time)
            self.histogram_prefill_time_request.observe(finished.prefill_time)
            self.histogram_decode_time_request.observe(finished.decode_time)

    # --8<-- [end:prometheus_record]

    def render(self) -> bytes:
        """The Prometheus text format (what GET /metrics returns)."""
        return generate_latest(self.registry)
