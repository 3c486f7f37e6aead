"""Scheduler and request statistics.

Mirrors vllm/v1/metrics/stats.py (``PrefixCacheStats``, ``SchedulerStats``,
``RequestStateStats``). Left out: LoRA, spec-decode, connector, cudagraph and
perf stats, and the Prometheus loggers. They are plain dataclasses, which
msgspec encodes as they are inside ``EngineCoreOutputs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last report (counted in tokens)."""

    reset: bool = False
    # Requests looked up, tokens asked for, tokens found.
    requests: int = 0
    queries: int = 0
    hits: int = 0
    # The same, for requests resumed after preemption.
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass
class SchedulerStats:
    """What the scheduler looked like after one step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    step_counter: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # tracevllm additions, for the views: KV pool counts and this step's preemptions.
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_blocks: int = 0
    num_preempted_reqs: int = 0


@dataclass
class RequestStateStats:
    """Timestamps the frontend keeps per request (wall clock, seconds)."""

    num_generation_tokens: int = 0
    arrival_time: float = 0.0
    # Engine-core event times, from EngineCoreOutput.events.
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    # Frontend times.
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0
