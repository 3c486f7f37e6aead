"""Scheduler and request statistics.

Mirrors vllm/v1/metrics/stats.py (``PrefixCacheStats``, ``PrefillStats``,
``SchedulerStats``, ``RequestStateStats``, ``FinishedRequestStats``,
``PromptTokenStats``, ``IterationStats``). With a KV connector,
``SchedulerStats`` carries vLLM's ``connector_prefix_cache_stats`` (prompt
tokens asked of the connector after the local prefix hit, and those it had)
and ``kv_connector_stats`` (the connector's own counters, a dict: here the
scheduler side's ``get_kv_connector_stats``, as vLLM when its workers report
none). Left out: LoRA, cudagraph and perf stats, KV eviction events,
corrupted-request counts. A request aborted in the frontend (its client hung up) is a finished
request too, with ``FinishReason.ABORT`` and the intervals it lived to see:
vLLM 0.22.0 drops it from every per-request stat (vllm-project/vllm#31503),
so that its ``request_success{finished_reason="abort"}`` never moves. One
that ends before its prefill's first token (``prefilled`` False: aborted
while waiting) counts in ``request_success``, the end-to-end latency, its
generated tokens (none) and its parameters, not in the prompt-token and
phase-time histograms: it computed no prompt the frontend knows of. The
ones that cross the process boundary inside ``EngineCoreOutputs``
(``SchedulerStats``, ``PrefillStats``) are plain dataclasses, which msgspec
encodes as they are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tracevllm.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from tracevllm.engine import EngineCoreEvent, EngineCoreOutput, FinishReason


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
class PrefillStats:
    """How a request's first prefill was served: computed, found in the local
    prefix cache, or brought by the KV connector (another engine's KV, the
    offload tier): vLLM's ``num_local_cached_tokens`` and
    ``num_external_cached_tokens``."""

    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0

    def set(
        self,
        num_prompt_tokens: int,
        num_local_cached_tokens: int,
        num_external_cached_tokens: int = 0,
    ) -> None:
        num_cached_tokens = num_local_cached_tokens + num_external_cached_tokens
        assert num_cached_tokens <= num_prompt_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = num_prompt_tokens - num_cached_tokens
        self.num_cached_tokens = num_cached_tokens
        self.num_local_cached_tokens = num_local_cached_tokens
        self.num_external_cached_tokens = num_external_cached_tokens


@dataclass
class SchedulerStats:
    """What the scheduler looked like after one step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    step_counter: int = 0
    # The data-parallel request wave (DPEngineCoreProc's counts for the coordinator).
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # With a KV connector (and log_stats): its lookups since the last report.
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    # tracevllm additions, for the views: KV pool counts and this step's preemptions.
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_blocks: int = 0
    num_preempted_reqs: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None
    # The KV connector's own counters (get_kv_connector_stats), when it has any.
    kv_connector_stats: dict[str, Any] | None = None


@dataclass
class RequestStateStats:
    """What the frontend keeps per request across outputs.

    ``arrival_time`` is the frontend's wall clock; the other timestamps are
    the engine core's monotonic clock, so only their differences mean anything.
    """

    num_generation_tokens: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    # Frontend: arrival to first token, wall clock.
    first_token_latency: float = 0.0
    # Speculative decoding: steps that verified drafts, drafts, drafts accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # tracevllm: its prefill's stats came (with its first token), so its
    # prompt was computed; a request that ends before (aborted while waiting,
    # a grammar that failed to compile) did no prompt work to count.
    prefilled: bool = False


@dataclass
class FinishedRequestStats:
    """One finished request's latencies (what the Prometheus histograms take)."""

    finish_reason: FinishReason
    request_id: str | None = None
    e2e_latency: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    queued_time: float = 0.0
    prefill_time: float = 0.0
    inference_time: float = 0.0
    decode_time: float = 0.0
    mean_time_per_output_token: float = 0.0
    num_cached_tokens: int = 0
    # tracevllm: False for a request that ended before its prefill (its
    # prompt tokens and phase times are not observed; vLLM's finished
    # requests all have them).
    prefilled: bool = True


@dataclass
class PromptTokenStats:
    """Prompt tokens of one iteration, by where their KV came from."""

    # The ``source`` label values of vllm:prompt_tokens_by_source.
    ALL_SOURCES: ClassVar[tuple[str, ...]] = (
        "local_compute",
        "local_cache_hit",
        "external_kv_transfer",
    )

    computed: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    cached_tokens: int = 0
    total: int = 0

    def update_from_output(self, prefill_stats: PrefillStats) -> None:
        self.computed += prefill_stats.num_computed_tokens
        self.cached_tokens += prefill_stats.num_cached_tokens
        self.total += prefill_stats.num_prompt_tokens
        self.local_cache_hit += prefill_stats.num_local_cached_tokens
        self.external_kv_transfer += prefill_stats.num_external_cached_tokens

    def get_by_source(self, source: str) -> int:
        if source == "local_compute":
            return self.computed
        if source == "local_cache_hit":
            return self.local_cache_hit
        if source == "external_kv_transfer":
            return self.external_kv_transfer
        raise ValueError(f"Unknown source {source!r}; known: {self.ALL_SOURCES}.")


class IterationStats:
    """What one batch of EngineCoreOutputs did, for the stat loggers.

    Made by the frontend per batch of outputs; the output processor fills
    it while it walks the batch (one loop, as vLLM insists).
    """

    def __init__(self) -> None:
        self.iteration_timestamp = time.time()
        self.num_generation_tokens = 0
        self.prompt_token_stats = PromptTokenStats()
        self.num_preempted_reqs = 0
        self.finished_requests: list[FinishedRequestStats] = []
        self.time_to_first_tokens_iter: list[float] = []
        self.inter_token_latencies_iter: list[float] = []
        # Per finished user request (all n children done): the longest
        # child's generated tokens, and its n.
        self.max_num_generation_tokens_iter: list[int] = []
        self.n_params_iter: list[int] = []

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_token_stats.total

    def _time_since(self, start: float) -> float:
        return self.iteration_timestamp - start

    # --8<-- [start:latency_stats]
    def update_from_output(
        self,
        output: EngineCoreOutput,
        engine_core_timestamp: float,
        is_prefilling: bool,
        req_stats: RequestStateStats,
    ) -> None:
        num_new_generation_tokens = len(output.new_token_ids)
        self.num_generation_tokens += num_new_generation_tokens
        if is_prefilling:
            if output.prefill_stats is not None:
                self.prompt_token_stats.update_from_output(output.prefill_stats)
                req_stats.prefilled = True
            first_token_latency = self._time_since(req_stats.arrival_time)
            self.time_to_first_tokens_iter.append(first_token_latency)
            req_stats.first_token_latency = first_token_latency
        req_stats.num_generation_tokens += num_new_generation_tokens
        if output.num_draft_tokens:
            req_stats.num_drafts += 1
            req_stats.num_draft_tokens += output.num_draft_tokens
            req_stats.num_accepted_tokens += output.num_accepted_tokens
        if output.events is not None:
            self.update_from_events(output.events, req_stats)
        if is_prefilling:
            req_stats.first_token_ts = engine_core_timestamp
        else:
            self.inter_token_latencies_iter.append(engine_core_timestamp - req_stats.last_token_ts)
        req_stats.last_token_ts = engine_core_timestamp

    # --8<-- [end:latency_stats]

    def update_from_events(
        self, events: list[EngineCoreEvent], req_stats: RequestStateStats
    ) -> None:
        from tracevllm.engine import EngineCoreEventType

        for event in events:
            if event.type == EngineCoreEventType.QUEUED:
                req_stats.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED:
                if req_stats.scheduled_ts == 0.0:  # not again after a preemption
                    req_stats.scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                self.num_preempted_reqs += 1

    def update_from_finished_request(
        self,
        finish_reason: FinishReason,
        request_id: str,
        num_prompt_tokens: int,
        max_tokens_param: int | None,
        req_stats: RequestStateStats,
        num_cached_tokens: int = 0,
    ) -> None:
        # Queued: first QUEUED to first SCHEDULED; prefill: SCHEDULED to the
        # first token; decode: first to last token; inference: SCHEDULED to
        # the last token (preemptions included). An interval whose ends the
        # request never reached (aborted while waiting) is 0, not a
        # difference with an unset timestamp.
        queued_ts, scheduled_ts = req_stats.queued_ts, req_stats.scheduled_ts
        first_token_ts, last_token_ts = req_stats.first_token_ts, req_stats.last_token_ts
        decode_time = _interval(first_token_ts, last_token_ts)
        self.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                request_id=request_id,
                e2e_latency=self._time_since(req_stats.arrival_time),
                num_prompt_tokens=num_prompt_tokens,
                num_generation_tokens=req_stats.num_generation_tokens,
                max_tokens_param=max_tokens_param,
                queued_time=_interval(queued_ts, scheduled_ts),
                prefill_time=_interval(scheduled_ts, first_token_ts),
                inference_time=_interval(scheduled_ts, last_token_ts),
                decode_time=decode_time,
                # The prefill's token is not a decode step.
                mean_time_per_output_token=(
                    decode_time / (req_stats.num_generation_tokens - 1)
                    if req_stats.num_generation_tokens > 1
                    else 0.0
                ),
                num_cached_tokens=num_cached_tokens,
                prefilled=req_stats.prefilled,
            )
        )


def _interval(start: float, end: float) -> float:
    """``end - start`` on the engine core's clock; 0 if either was never stamped."""
    return end - start if start and end else 0.0
