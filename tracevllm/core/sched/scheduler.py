"""The scheduler: each step, which requests run and how many tokens each.

Mirrors vllm/v1/core/sched/scheduler.py (``Scheduler``), synchronous path.
There are no prefill and decode phases: every request has
``num_computed_tokens`` and ``num_tokens``, and each step hands out a token
budget so the first catches up with the second. That one rule covers chunked
prefill, prefix caching and preemption. A structured-output request waits
in ``skipped_waiting`` until its grammar is compiled; each step
``get_grammar_bitmask`` asks the ``StructuredOutputManager`` for the mask of
the structured requests it scheduled, and ``update_from_output`` advances
their matchers. With speculative decoding a running request also carries
the drafts proposed after the last step (``spec_token_ids``): they are
scheduled with it (``scheduled_spec_decode_tokens``), and after the step
``num_computed_tokens`` goes back by the drafts the target rejected.
Async scheduling (``AsyncScheduler``, core/sched/async_scheduler.py) counts
the tokens of steps still in flight as ``num_output_placeholders``: they
enter ``num_new_tokens`` here, as in vLLM. A KV connector (``kv_transfer_config``)
is asked, for each waiting request, how many prompt tokens past the local
prefix-cache hit it can supply (``get_num_new_matched_tokens``); their blocks
are allocated with the rest and the connector told (``update_state_after_alloc``),
and only the remainder is scheduled. A connector that loads asynchronously
parks the request in ``WAITING_FOR_REMOTE_KVS`` until a step reports it in
``finished_recving``. Each step carries the connector's metadata to the
workers (``build_connector_meta``); a finished request may leave its blocks
to the connector (``request_finished``: freed on ``finished_sending``) and
returns its ``kv_transfer_params``. Blocks that failed to load are
recomputed or fail their requests (``kv_load_failure_policy``). Left out:
encoder inputs, LoRA, streaming input, pause states and KV events. With pipeline parallelism
each step carries the tokens it runs (``new_token_ids``), as vLLM's sync path.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from tracevllm import tracing
from tracevllm.config import VllmConfig
from tracevllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from tracevllm.core.sched.output import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    SchedulerOutput,
)
from tracevllm.core.sched.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from tracevllm.core.sched.utils import check_stop, remove_all
from tracevllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from tracevllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from tracevllm.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from tracevllm.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from tracevllm.labs import lab_hook
from tracevllm.logger import init_logger
from tracevllm.metrics.stats import PrefixCacheStats, SchedulerStats
from tracevllm.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from tracevllm.request import Request, RequestStatus
from tracevllm.spec_decode.metrics import SpecDecodingStats
from tracevllm.structured_output import StructuredOutputManager
from tracevllm.tracing import records

logger = init_logger(__name__)


# --8<-- [start:compute_num_new_tokens]
@lab_hook("compute_num_new_tokens")  # lab 01: chapters/01-token-budget
def compute_num_new_tokens(
    num_tokens: int,
    num_computed_tokens: int,
    token_budget: int,
    long_prefill_token_threshold: int,
    max_model_len: int,
    enable_chunked_prefill: bool = True,
) -> int:
    """How many of a request's tokens to schedule this step; 0 means none.

    The token-budget arithmetic that vLLM writes inline in both passes of
    ``Scheduler.schedule`` (tracevllm names it, for the book and lab 01).
    A request wants ``num_tokens - num_computed_tokens`` tokens: 1 for a
    decode, the rest of its prompt for a prefill. That is cut to
    ``long_prefill_token_threshold`` (if > 0) and to the step's
    ``token_budget``: a cut prefill is a chunked prefill. Without chunked
    prefill a request that does not fit gets 0 (it waits). No token may sit
    at position ``max_model_len - 1`` or later: there is no room for the
    token it would produce. (vLLM applies that cap in the running pass only;
    a waiting request never holds more than ``max_model_len - 1`` tokens, so
    for it the cap changes nothing.)
    """
    num_new_tokens = num_tokens - num_computed_tokens
    if 0 < long_prefill_token_threshold < num_new_tokens:
        num_new_tokens = long_prefill_token_threshold
    if not enable_chunked_prefill and num_new_tokens > token_budget:
        return 0
    num_new_tokens = min(num_new_tokens, token_budget)
    # No input position at or past max_model_len.
    num_new_tokens = min(num_new_tokens, max_model_len - 1 - num_computed_tokens)
    return max(num_new_tokens, 0)


# --8<-- [end:compute_num_new_tokens]


class Scheduler:
    def __init__(
        self,
        vllm_config: VllmConfig,
        log_stats: bool = True,
        include_finished_set: bool = False,
        structured_output_manager: StructuredOutputManager | None = None,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.structured_output_manager = structured_output_manager or StructuredOutputManager(
            vllm_config
        )
        self.scheduler_config = vllm_config.scheduler_config
        self.cache_config = vllm_config.cache_config
        self.log_stats = log_stats
        self.max_num_running_reqs = self.scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = self.scheduler_config.max_num_scheduled_tokens
        self.max_model_len = vllm_config.model_config.get_max_model_len()
        self.policy = SchedulingPolicy(self.scheduler_config.policy)

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        # Waiting requests that cannot run yet: their grammar is compiling.
        self.skipped_waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished in schedule() (their grammar failed to compile): reported
        # by the next update_from_output.
        self.finished_in_schedule: list[Request] = []
        # Finished since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        # Finished since the last update_from_output(), per client: sent back
        # as EngineCoreOutputs.finished_requests when asked for (vLLM's
        # data-parallel clients count in-flight requests with it).
        self.finished_req_ids_dict: dict[int, set[str]] | None = (
            defaultdict(set) if include_finished_set else None
        )
        self.prev_step_scheduled_req_ids: set[str] = set()
        self.step_id = 0
        self.num_preempted_reqs = 0  # in the last step, for make_stats
        self.spec_decoding_stats: SpecDecodingStats | None = None  # likewise
        # Pipeline stages other than the last do not sample: each step tells
        # them the tokens they run (_make_cached_request_data).
        self.use_pp = vllm_config.parallel_config.pipeline_parallel_size > 1

        # Drafts per step; a draft model also writes its KV that many slots
        # ahead of the tokens it was given (vLLM's lookahead slots).
        speculative_config = vllm_config.speculative_config
        self.num_spec_tokens = self.num_lookahead_tokens = 0
        if speculative_config is not None:
            assert speculative_config.num_speculative_tokens is not None
            self.num_spec_tokens = speculative_config.num_speculative_tokens
            if speculative_config.uses_draft_model():
                self.num_lookahead_tokens = self.num_spec_tokens

        self.block_size = self.cache_config.block_size
        if kv_cache_config is None:
            # A scheduler built alone (tests, labs): one full-attention group of
            # cache_config.num_gpu_blocks blocks. EngineCore passes the config
            # it sized; the scheduler reads only the block size and count.
            num_gpu_blocks = self.cache_config.num_gpu_blocks
            assert num_gpu_blocks is not None, "EngineCore sets num_gpu_blocks first"
            spec = FullAttentionSpec(
                block_size=self.block_size, num_kv_heads=1, head_size=1, dtype="float32"
            )
            kv_cache_config = KVCacheConfig(num_gpu_blocks, [], [KVCacheGroupSpec(["attn"], spec)])
        self.kv_cache_config = kv_cache_config
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config=kv_cache_config,
            max_model_len=self.max_model_len,
            hash_block_size=self.block_size,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            enable_caching=self.cache_config.enable_prefix_caching,
            log_stats=log_stats,
        )

        # --8<-- [start:connector_init]
        # The KV connector's scheduler side; each worker has its own (WORKER role).
        self.connector: KVConnectorBase_V1 | None = None
        self.recompute_kv_load_failures = True
        if vllm_config.kv_transfer_config is not None:
            self.connector = KVConnectorFactory.create_connector(
                config=vllm_config,
                role=KVConnectorRole.SCHEDULER,
                kv_cache_config=self.kv_cache_config,
            )
            policy = vllm_config.kv_transfer_config.kv_load_failure_policy
            self.recompute_kv_load_failures = policy == "recompute"
        # Requests whose asynchronous load finished (or failed), from the
        # workers' finished_recving, until the waiting loop picks them up.
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        # --8<-- [end:connector_init]
        # vLLM's external prefix-cache counts since the last make_stats.
        self.connector_prefix_cache_stats: PrefixCacheStats | None = (
            PrefixCacheStats() if self.connector is not None and log_stats else None
        )

    @tracing.instrument("Scheduler.schedule", record=records.record_schedule)
    def schedule(self) -> SchedulerOutput:
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        token_budget = self.max_num_scheduled_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        scheduled_timestamp = time.monotonic()
        self.step_id += 1

        # --8<-- [start:schedule_running]
        # Pass 1, RUNNING requests in order: a decode needs one token (plus
        # its drafts), an unfinished (chunked) prefill the rest of its prompt.
        # If the pool is out of blocks, preempt from the back until this
        # request fits.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if (
                request.num_output_placeholders > 0
                and request.num_computed_tokens + 2 - request.num_output_placeholders
                >= request.num_prompt_tokens + request.max_tokens
            ):
                # Async scheduling: the step in flight reaches max_tokens; no
                # step after it (vLLM's check, drafts aside).
                req_index += 1
                continue
            num_new_tokens = compute_num_new_tokens(
                # Placeholders: tokens of a step in flight, not yet sampled.
                request.num_tokens_with_spec + request.num_output_placeholders,
                request.num_computed_tokens,
                token_budget,
                threshold,
                self.max_model_len,
                # Admitted already: it goes on chunk by chunk whatever the setting.
                enable_chunked_prefill=True,
            )
            if num_new_tokens == 0:
                req_index += 1
                continue

            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
                )
                if new_blocks is not None:
                    break
                if self.policy == SchedulingPolicy.PRIORITY:
                    # The lowest priority (largest value), latest arrival. If it
                    # was already scheduled this step, take back its tokens.
                    victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    self.running.remove(victim)
                    if victim in scheduled_running_reqs:
                        scheduled_running_reqs.remove(victim)
                        token_budget += num_scheduled_tokens.pop(victim.request_id)
                        req_to_new_blocks.pop(victim.request_id)
                        scheduled_spec_decode_tokens.pop(victim.request_id, None)
                        req_index -= 1
                else:
                    # FCFS: the last admitted, which is not scheduled yet.
                    victim = self.running.pop()
                self._preempt_request(victim, scheduled_timestamp)
                preempted_reqs.append(victim)
                if victim is request:
                    break  # nothing left to preempt: it waits instead
            if new_blocks is None:
                break

            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

            # --8<-- [start:schedule_spec_tokens]
            # The drafts that fit go along (the budget or max_model_len may
            # cut them); the next ones come from update_draft_token_ids.
            if request.spec_token_ids:
                num_scheduled_spec_tokens = (
                    num_new_tokens
                    + request.num_computed_tokens
                    - request.num_tokens
                    - request.num_output_placeholders
                )
                if num_scheduled_spec_tokens > 0:
                    scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[
                        :num_scheduled_spec_tokens
                    ]
                request.spec_token_ids = []
            # --8<-- [end:schedule_spec_tokens]
        # --8<-- [end:schedule_running]

        # --8<-- [start:schedule_waiting]
        # Pass 2, WAITING requests (new or preempted), only if nothing was
        # preempted this step: admitting work while evicting it would thrash.
        # No preemption here; the first request that does not fit ends the pass.
        if not preempted_reqs:
            step_skipped_waiting = create_request_queue(self.policy)
            while (self.waiting or self.skipped_waiting) and token_budget > 0:
                if len(self.running) == self.max_num_running_reqs:
                    break
                request_queue = self._select_waiting_queue_for_scheduling()
                request = request_queue.peek_request()
                # A request whose grammar is still compiling is passed over.
                if self._is_blocked_waiting_status(
                    request.status
                ) and not self._try_promote_blocked_waiting_request(request):
                    request_queue.pop_request()
                    if not request.is_finished():
                        step_skipped_waiting.prepend_request(request)
                    continue
                # --8<-- [start:connector_match]
                num_external_computed_tokens = 0
                load_kv_async = False
                if request.num_computed_tokens == 0:
                    # The local prefix cache first, then the KV connector for
                    # what follows it.
                    new_computed_blocks, num_new_local_computed_tokens = (
                        self.kv_cache_manager.get_computed_blocks(request)
                    )
                    if self.connector is not None:
                        ext_tokens, load_kv_async = self.connector.get_num_new_matched_tokens(
                            request, num_new_local_computed_tokens
                        )
                        if ext_tokens is None:
                            # The connector cannot tell yet: ask again next step.
                            request_queue.pop_request()
                            step_skipped_waiting.prepend_request(request)
                            continue
                        num_external_computed_tokens = ext_tokens
                    num_computed_tokens = (
                        num_new_local_computed_tokens + num_external_computed_tokens
                    )
                    assert num_computed_tokens <= request.num_tokens
                    # The first prefill only, not a recompute after preemption,
                    # nor an admission after giving back loaded blocks (its
                    # loaded tokens, now local hits, stay external).
                    if request.prefill_stats is not None and not request.gave_back_loaded_blocks:
                        request.prefill_stats.set(
                            request.num_prompt_tokens,
                            num_new_local_computed_tokens,
                            num_external_computed_tokens,
                        )
                else:
                    # An asynchronous load finished: its blocks are allocated and full.
                    new_computed_blocks = self.kv_cache_manager.empty_kv_cache_blocks
                    num_new_local_computed_tokens = 0
                    num_computed_tokens = request.num_computed_tokens
                # --8<-- [end:connector_match]

                if load_kv_async:
                    # Only slots for the tokens being loaded; nothing runs yet.
                    assert num_external_computed_tokens > 0
                    num_new_tokens = 0
                else:
                    # num_tokens, not num_prompt_tokens: a resumed request
                    # recomputes its outputs too.
                    num_new_tokens = compute_num_new_tokens(
                        request.num_tokens,
                        num_computed_tokens,
                        token_budget,
                        threshold,
                        self.max_model_len,
                        self.scheduler_config.enable_chunked_prefill,
                    )
                    if num_new_tokens == 0:
                        break  # without chunked prefill, a prompt that does not fit waits

                # The connector's tokens get fresh blocks after the local hit;
                # an asynchronous load's are entered in the prefix cache only
                # once loaded (_update_waiting_for_remote_kv), so that no other
                # request hits blocks that hold nothing yet. An asynchronous
                # load takes blocks for the loaded tokens only: it is admitted
                # only if the request's whole sequence fits besides (vLLM's
                # full_sequence_must_fit gate, which vLLM puts on every
                # admission), so that once loaded it can usually run.
                new_blocks = None
                if not load_kv_async or self.kv_cache_manager.full_sequence_fits(
                    request,
                    num_new_local_computed_tokens,
                    new_computed_blocks,
                    num_external_computed_tokens,
                ):
                    new_blocks = self.kv_cache_manager.allocate_slots(
                        request,
                        num_new_tokens,
                        num_new_computed_tokens=num_new_local_computed_tokens,
                        new_computed_blocks=new_computed_blocks,
                        # vLLM passes 0 for a request with no computed tokens (a
                        # P/D edge case); here the draft model writes its drafts
                        # right after the prefill, so they need their slots now.
                        num_lookahead_tokens=0 if load_kv_async else self.num_lookahead_tokens,
                        num_external_computed_tokens=num_external_computed_tokens,
                        delay_cache_blocks=load_kv_async,
                    )
                if new_blocks is None:
                    # tracevllm departs from vLLM here: vLLM 0.22 just breaks.
                    # With nothing running and nothing scheduled, no step
                    # would ever free a block: waiting requests whose
                    # asynchronous load has finished hold them, and only
                    # running requests are preempted. One of them lets go.
                    if not self.running and not num_scheduled_tokens:
                        self._free_loaded_waiting_request(request)
                    break

                # --8<-- [start:connector_alloc]
                # The connector learns which blocks its tokens go into.
                if self.connector is not None:
                    self.connector.update_state_after_alloc(
                        request,
                        self.kv_cache_manager.get_blocks(request.request_id),
                        num_external_computed_tokens,
                    )
                    if (
                        self.connector_prefix_cache_stats is not None
                        and request.num_computed_tokens == 0  # not a finished async load
                        and not request.gave_back_loaded_blocks  # counted when first admitted
                    ):
                        self.connector_prefix_cache_stats.record(
                            num_tokens=request.num_tokens - num_new_local_computed_tokens,
                            num_hits=num_external_computed_tokens,
                            preempted=request.num_preemptions > 0,
                        )
                request.gave_back_loaded_blocks = False
                request = request_queue.pop_request()
                if load_kv_async:
                    # Its slots are held while the load runs between steps;
                    # num_computed_tokens counts the loaded tokens already.
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    step_skipped_waiting.prepend_request(request)
                    request.num_computed_tokens = num_computed_tokens
                    continue
                # --8<-- [end:connector_alloc]
                self.running.append(request)
                if self.log_stats:
                    request.record_event(EngineCoreEventType.SCHEDULED, scheduled_timestamp)
                if request.status == RequestStatus.WAITING:
                    scheduled_new_reqs.append(request)
                else:
                    assert request.status == RequestStatus.PREEMPTED, request.status
                    scheduled_resumed_reqs.append(request)
                # New and resumed requests get their whole block table.
                req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
                    request.request_id
                )
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed_tokens
            # Back ahead of older skipped ones, in their order.
            if step_skipped_waiting:
                self.skipped_waiting.prepend_requests(step_skipped_waiting)
        # --8<-- [end:schedule_waiting]

        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs
        self.num_preempted_reqs = len(preempted_reqs)

        num_common_prefix_blocks = [0]
        if self.running:
            num_common_prefix_blocks = self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0].request_id
            )
        new_reqs_data = [
            NewRequestData.from_request(req, req_to_new_blocks[req.request_id].get_block_ids())
            for req in scheduled_new_reqs
        ]
        cached_reqs_data = self._make_cached_request_data(
            scheduled_running_reqs,
            scheduled_resumed_reqs,
            num_scheduled_tokens,
            scheduled_spec_decode_tokens,
            req_to_new_blocks,
        )
        self.prev_step_scheduled_req_ids = set(num_scheduled_tokens)
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={req.request_id for req in preempted_reqs},
            step_id=self.step_id,
        )
        # What the workers' connectors load and save this step (and the end
        # of the scheduler-side connector's per-step state).
        if self.connector is not None:
            scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(
                scheduler_output
            )
        self._update_after_schedule(scheduler_output)
        return scheduler_output

    # --8<-- [start:preempt_request]
    def _preempt_request(self, request: Request, timestamp: float) -> None:
        """Send a running request back to the front of the waiting queue.

        Its blocks are freed, but full ones keep their hashes: when it is
        admitted again, get_computed_blocks finds whatever was not evicted in
        the meantime, and only the rest is recomputed. The caller has already
        taken it out of ``running``.
        """
        assert request.status == RequestStatus.RUNNING, "only running requests are preempted"
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # drafts of a state it no longer has
        request.num_preemptions += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
        self.waiting.prepend_request(request)

    # --8<-- [end:preempt_request]

    def _free_loaded_waiting_request(self, head: Request) -> Request | None:
        """Free the blocks of the youngest waiting request (``head`` aside)
        whose asynchronous load has finished; returns it, or None if there is
        none. The scheduler calls it when ``head`` cannot get its blocks while
        nothing runs and nothing was scheduled this step.

        A request whose load has finished keeps its blocks while it waits
        (vLLM's way: it runs from past its loaded tokens). If such requests
        hold every free block, the waiting pass cannot admit anything, no
        running request is there to preempt, and vLLM 0.22 steps without end
        (its waiting pass breaks at the same place). Here one of them lets go:
        its loaded blocks are in the prefix cache already
        (``_update_waiting_for_remote_kv``), so when it is admitted again it
        finds them there (those not evicted meanwhile) and computes only the
        rest; that admission is not counted again (``gave_back_loaded_blocks``:
        its prefill stats and connector lookup stay the first admission's,
        the loaded tokens external). A request still loading (``WAITING_FOR_REMOTE_KVS``) keeps its
        blocks: the load is writing into them.
        """

        def has_loaded(r: Request) -> bool:
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                return r.request_id in self.finished_recving_kv_req_ids
            return (
                r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                and r.num_computed_tokens > 0
            )

        candidates = [
            r for r in (*self.skipped_waiting, *self.waiting) if r is not head and has_loaded(r)
        ]
        if not candidates:
            return None
        # The lowest priority (priority policy), then the latest arrival, then
        # the last in queue order.
        use_priority = self.policy == SchedulingPolicy.PRIORITY
        _, victim = max(
            enumerate(candidates),
            key=lambda ir: (ir[1].priority if use_priority else 0, ir[1].arrival_time, ir[0]),
        )
        if victim.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # Loaded, not yet picked up: its blocks enter the prefix cache first.
            self._try_promote_blocked_waiting_request(victim)
        if victim.num_computed_tokens > 0:  # (a load that failed has let go already)
            self.kv_cache_manager.free(victim)
            victim.num_computed_tokens = 0
            victim.gave_back_loaded_blocks = True
        logger.debug(
            "Request %s gives back its loaded blocks: request %s cannot get blocks and "
            "nothing runs",
            victim.request_id,
            head.request_id,
        )
        return victim

    # --8<-- [start:update_after_schedule]
    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advance num_computed_tokens now, before the forward pass runs, so the
        next schedule() does not hand out the same tokens again."""
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_tokens
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders
            )
            scheduler_output.has_structured_output_requests |= (
                request.use_structured_output and not request.is_prefill_chunk
            )
        # A new set: the output just built keeps the old one.
        self.finished_req_ids = set()

    # --8<-- [end:update_after_schedule]

    def _make_cached_request_data(
        self,
        running_reqs: list[Request],
        resumed_reqs: list[Request],
        num_scheduled_tokens: dict[str, int],
        spec_decode_tokens: dict[str, list[int]],
        req_to_new_blocks: dict[str, KVCacheBlocks],
    ) -> CachedRequestData:
        # Resumed requests come last; the runner replaces their block ids.
        data = CachedRequestData(resumed_req_ids={r.request_id for r in resumed_reqs})
        for req in running_reqs + resumed_reqs:
            req_id = req.request_id
            data.req_ids.append(req_id)
            if self.use_pp and not self.scheduler_config.async_scheduling:
                # The tokens this step runs (drafts aside): the first stage
                # never hears from the last, which sampled them.
                num_tokens = num_scheduled_tokens[req_id] - len(spec_decode_tokens.get(req_id, ()))
                start = req.num_computed_tokens
                data.new_token_ids.append(req.all_token_ids[start : start + num_tokens])
            # For a request not scheduled last step, the whole sequence goes
            # along, as in vLLM: KV connectors read it, and async scheduling
            # rebuilds a resumed request's outputs from it. The synchronous
            # runner keeps its own copy of the tokens and does not need it.
            if req_id not in self.prev_step_scheduled_req_ids:
                data.all_token_ids[req_id] = req.all_token_ids.copy()
            block_ids = req_to_new_blocks[req_id].get_block_ids()
            data.new_block_ids.append(block_ids if any(block_ids) else None)
            data.num_computed_tokens.append(req.num_computed_tokens)
            data.num_output_tokens.append(req.num_output_tokens + req.num_output_placeholders)
        return data

    # --8<-- [start:waiting_for_grammar]
    @staticmethod
    def _is_blocked_waiting_status(status: RequestStatus) -> bool:
        return status in (
            RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
            RequestStatus.WAITING_FOR_REMOTE_KVS,
        )

    def _enqueue_waiting_request(self, request: Request) -> None:
        if self._is_blocked_waiting_status(request.status):
            self.skipped_waiting.add_request(request)
        else:
            self.waiting.add_request(request)

    def _select_waiting_queue_for_scheduling(self) -> RequestQueue:
        """FCFS: the skipped ones first (they came earlier); priority: the
        better of the two heads."""
        if self.policy == SchedulingPolicy.PRIORITY and self.waiting and self.skipped_waiting:
            waiting_req = self.waiting.peek_request()
            skipped_req = self.skipped_waiting.peek_request()
            return self.waiting if waiting_req < skipped_req else self.skipped_waiting
        return self.skipped_waiting or self.waiting

    def _try_promote_blocked_waiting_request(self, request: Request) -> bool:
        """WAITING once its grammar is compiled. A grammar that failed to
        compile finishes the request with an error (vLLM leaves it a TODO):
        the engine goes on serving the others. A request waiting for remote
        KV is WAITING (or PREEMPTED) again once its load is reported."""
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if request.request_id not in self.finished_recving_kv_req_ids:
                return False
            self._update_waiting_for_remote_kv(request)
            request.status = (
                RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            )
            return True
        so_request = request.structured_output_request
        assert so_request is not None
        try:
            if so_request.grammar is None:
                return False
        except Exception as e:
            logger.error("Grammar for request %s failed to compile: %s", request.request_id, e)
            request.status = RequestStatus.FINISHED_ERROR
            # tracevllm: the reason goes to the client (stop_reason of an error);
            # the manager's _create_grammar wrote it.
            request.stop_reason = str(e)
            self._free_request(request)
            self.finished_in_schedule.append(request)
            return False
        request.status = RequestStatus.WAITING
        return True

    # --8<-- [end:waiting_for_grammar]

    # --8<-- [start:get_grammar_bitmask]
    @tracing.instrument("Scheduler.get_grammar_bitmask", record=records.get_grammar_bitmask)
    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The token bitmask of the structured requests scheduled this step.

        A request mid-prefill samples nothing worth keeping: no row for it.
        The rows are in scheduling order; the runner puts them in batch order.
        """
        if not scheduler_output.has_structured_output_requests:
            return None
        structured_output_request_ids = [
            req_id
            for req_id in scheduler_output.num_scheduled_tokens
            if (req := self.requests.get(req_id))
            and req.use_structured_output
            and not req.is_prefill_chunk
        ]
        if not structured_output_request_ids:
            return None
        bitmask = self.structured_output_manager.grammar_bitmask(
            self.requests,
            structured_output_request_ids,
            scheduler_output.scheduled_spec_decode_tokens,
        )
        assert bitmask is not None
        return GrammarOutput(structured_output_request_ids, bitmask)

    # --8<-- [end:get_grammar_bitmask]

    # --8<-- [start:update_from_output]
    @tracing.instrument("Scheduler.update_from_output", record=records.update_from_output)
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Take in one step's sampled tokens: append them, check for a stop,
        free what finished, and build the outputs for each frontend client."""
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        stopped_reqs: set[Request] = set()
        self.spec_decoding_stats = None
        kv_connector_output = model_runner_output.kv_connector_output
        failed_kv_load_req_ids: set[str] = set()
        if kv_connector_output is not None and kv_connector_output.invalid_block_ids:
            # Externally computed blocks that failed to load: their requests
            # go back to the first bad block (or fail), and this step's
            # sample, made from them, is dropped.
            failed_kv_load_req_ids = self._handle_invalid_blocks(
                kv_connector_output.invalid_block_ids, scheduler_output.num_scheduled_tokens
            )

        # One row per scheduled request. A partial prefill's row is empty: it
        # appends nothing and sends nothing.
        for req_id in scheduler_output.num_scheduled_tokens:
            if req_id in failed_kv_load_req_ids:
                continue  # recomputed next step, or failed below
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted while the step ran
            req_index = model_runner_output.req_id_to_index[req_id]
            new_token_ids = sampled_token_ids[req_index] if sampled_token_ids else []
            # --8<-- [start:rollback]
            # With drafts, the row holds the accepted drafts and one more token
            # (the bonus, or the target's own pick where a draft was rejected).
            # The KV written for the rejected drafts is simply overwritten later.
            num_draft_tokens = num_accepted = 0
            scheduled_spec_token_ids = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if scheduled_spec_token_ids and new_token_ids:
                num_draft_tokens = len(scheduled_spec_token_ids)
                num_accepted = len(new_token_ids) - 1
                request.num_computed_tokens -= num_draft_tokens - num_accepted
                self._observe_draft(num_draft_tokens, num_accepted)
            # --8<-- [end:rollback]
            stopped = False
            grammar_ending = None
            if new_token_ids and self.structured_output_manager.should_advance(request):
                # tracevllm: the grammar first (vLLM: after the stop checks), so
                # that a token it refuses, or one past its end, is never kept.
                new_token_ids, grammar_ending = self._advance_grammar(request, new_token_ids)
            if new_token_ids:
                new_token_ids, stopped = self._update_request_with_output(request, new_token_ids)
            if grammar_ending is not None and not stopped:
                request.status, request.stop_reason = grammar_ending
                stopped = True
            finish_reason = None
            kv_transfer_params = None
            if stopped:
                finish_reason = request.get_finished_reason()
                kv_transfer_params = self._free_request(request)
                stopped_reqs.add(request)
            new_logprobs = None
            if request.sampling_params.logprobs is not None and logprobs is not None:
                new_logprobs = logprobs.slice_request(req_index, len(new_token_ids))
            if new_token_ids or stopped or kv_transfer_params:
                outputs[request.client_index].append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=new_logprobs,
                        finish_reason=finish_reason,
                        stop_reason=request.stop_reason,
                        events=request.take_events(),
                        # tracevllm: sent once, on the last output (vLLM: on each).
                        trace_headers=request.trace_headers if stopped else None,
                        prefill_stats=request.take_prefill_stats(),
                        num_draft_tokens=num_draft_tokens,
                        num_accepted_tokens=num_accepted,
                        kv_transfer_params=kv_transfer_params,
                    )
                )
        if stopped_reqs:
            self.running = remove_all(self.running, stopped_reqs)
        # --8<-- [start:kv_load_failure_fail]
        if failed_kv_load_req_ids and not self.recompute_kv_load_failures:
            # Policy "fail": the requests end with an error; the engine goes on.
            failed = [self.requests[req_id] for req_id in failed_kv_load_req_ids]
            self.finish_requests(failed_kv_load_req_ids, RequestStatus.FINISHED_ERROR)
            for request in failed:
                outputs[request.client_index].append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=request.get_finished_reason(),
                        stop_reason="KV cache load failed",
                        events=request.take_events(),
                        trace_headers=request.trace_headers,
                        prefill_stats=request.take_prefill_stats(),
                    )
                )
        # --8<-- [end:kv_load_failure_fail]
        if kv_connector_output is not None:
            self._update_from_kv_xfer_finished(kv_connector_output)
        # Requests whose grammar failed to compile, finished in schedule().
        for request in self.finished_in_schedule:
            outputs[request.client_index].append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
            )
        self.finished_in_schedule.clear()

        engine_core_outputs = {
            client_index: EngineCoreOutputs(outputs=outs) for client_index, outs in outputs.items()
        }
        if finished_req_ids := self.finished_req_ids_dict:
            for client_index, finished in finished_req_ids.items():
                engine_core_outputs.setdefault(client_index, EngineCoreOutputs())
                engine_core_outputs[client_index].finished_requests = finished
            finished_req_ids.clear()
        if (stats := self.make_stats()) is not None:
            # Stats go to one client only, even in a step with no outputs.
            if not engine_core_outputs:
                engine_core_outputs[0] = EngineCoreOutputs()
            next(iter(engine_core_outputs.values())).scheduler_stats = stats
        return engine_core_outputs

    # --8<-- [end:update_from_output]

    # --8<-- [start:advance_grammar]
    def _advance_grammar(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], tuple[RequestStatus, str | None] | None]:
        """Move the request's matcher past its new tokens, one at a time.

        Returns the tokens to keep and, if the grammar ends the request, its
        status and the reason to give. A refused token is dropped, with the
        rest: the mask allowed only tokens the grammar accepts, so it was
        drawn from a row that allowed none (``no_token_allowed_reason``), or
        it is a bug, vLLM's "Unexpected"; either way the request finishes
        with an error, as in vLLM, which keeps the token. tracevllm also stops a
        request whose grammar has terminated (its stop token under
        ``ignore_eos``; vLLM refuses the next token, an error): at once, and
        with drafts after it too, so drafts change nothing.
        """
        so_request = request.structured_output_request
        assert so_request is not None and so_request.grammar is not None
        grammar = so_request.grammar
        for i, token in enumerate(new_token_ids):
            if grammar.is_terminated():  # an accepted draft was its stop token
                return new_token_ids[:i], (RequestStatus.FINISHED_STOPPED, None)
            if not grammar.accept_tokens(request.request_id, [token]):
                num_output_tokens = request.num_output_tokens + i
                manager = self.structured_output_manager
                reason = manager.no_token_allowed_reason(request, num_output_tokens)
                if reason is None:
                    logger.error(
                        "Unexpected: grammar rejected tokens %s for request %s. "
                        "Terminating request.",
                        new_token_ids[i:],
                        request.request_id,
                    )
                return new_token_ids[:i], (RequestStatus.FINISHED_ERROR, reason)
        if grammar.is_terminated():
            return new_token_ids, (RequestStatus.FINISHED_STOPPED, None)
        return new_token_ids, None

    # --8<-- [end:advance_grammar]

    def _observe_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one request's drafts in this step's stats (vLLM's make_spec_decoding_stats)."""
        if not self.log_stats:
            return
        if self.spec_decoding_stats is None:
            self.spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
        self.spec_decoding_stats.observe_draft(num_draft_tokens, num_accepted)

    # --8<-- [start:update_draft_token_ids]
    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Take the drafts the runner proposed after this step, for the next.

        A request mid-prefill gets none (its sample was thrown away); a
        structured request keeps only the drafts its grammar accepts.
        """
        for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished in this step
            if request.is_prefill_chunk:
                request.spec_token_ids = []
                continue
            if self.structured_output_manager.should_advance(request):
                so_request = request.structured_output_request
                assert so_request is not None and so_request.grammar is not None
                spec_token_ids = so_request.grammar.validate_tokens(spec_token_ids)
            request.spec_token_ids = spec_token_ids

    # --8<-- [end:update_draft_token_ids]

    # --8<-- [start:update_request_with_output]
    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Append tokens one at a time, dropping any after a stop: an accepted
        run of drafts is cut at the first token that stops the request."""
        for num_new, token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len):
                return new_token_ids[:num_new], True
        return new_token_ids, False

    # --8<-- [end:update_request_with_output]

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate id {request.request_id}"
        self._enqueue_waiting_request(request)
        self.requests[request.request_id] = request
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[tuple[str, int]]:
        """Finish requests from outside (an abort): take them out of the queues
        and free their blocks. None means all. Returns (req_id, client_index)
        of those that were still unfinished."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        elif request_ids is None:
            request_ids = list(self.requests)
        valid = [
            r
            for req_id in set(request_ids)
            if (r := self.requests.get(req_id)) is not None and not r.is_finished()
        ]
        running = {r for r in valid if r.status == RequestStatus.RUNNING}
        self.running = remove_all(self.running, running)
        # A waiting request is in one of the two queues; removing a request a
        # queue does not hold is a no-op.
        waiting = [r for r in valid if r not in running]
        self.waiting.remove_requests(waiting)
        self.skipped_waiting.remove_requests(waiting)
        for request in valid:
            # A load still in flight writes into the request's blocks: they
            # are freed when the workers report it done (finished_recving).
            delay_free_blocks = False
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                delay_free_blocks = request.request_id not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(request.request_id)
                self.failed_recving_kv_req_ids.discard(request.request_id)
            request.status = finished_status
            self._free_request(request, delay_free_blocks=delay_free_blocks)
        return [(r.request_id, r.client_index) for r in valid]

    # --8<-- [start:free_request]
    def _free_request(
        self, request: Request, delay_free_blocks: bool = False
    ) -> dict[str, Any] | None:
        """Finish the request's bookkeeping; free its blocks now unless a
        transfer still reads or writes them. Returns its kv_transfer_params."""
        assert request.is_finished()
        connector_delay_free_blocks, kv_xfer_params = self._connector_finished(request)
        self.finished_req_ids.add(request.request_id)
        if self.finished_req_ids_dict is not None:
            self.finished_req_ids_dict[request.client_index].add(request.request_id)
        if not (delay_free_blocks or connector_delay_free_blocks):
            self._free_blocks(request)
        return kv_xfer_params

    def _free_blocks(self, request: Request) -> None:
        assert request.is_finished()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    # --8<-- [end:free_request]

    # ------------------------------------------------------------ KV connector
    def _connector_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Tell the connector the request finished, with its blocks: (whether
        it keeps them for a transfer, the kv_transfer_params to return)."""
        if self.connector is None:
            return False, None
        (block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)
        return self.connector.request_finished(request, block_ids)

    # --8<-- [start:update_from_kv_xfer_finished]
    def _update_from_kv_xfer_finished(self, kv_connector_output: KVConnectorOutput) -> None:
        """The workers' report: a finished receive lets its request run (or,
        if it was aborted meanwhile, frees its blocks); a finished send frees
        the blocks the connector held."""
        if self.connector is not None:
            self.connector.update_connector_output(kv_connector_output)
        for req_id in kv_connector_output.finished_recving or ():
            request = self.requests[req_id]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            else:
                assert request.is_finished(), request
                self._free_blocks(request)
        for req_id in kv_connector_output.finished_sending or ():
            self._free_blocks(self.requests[req_id])

    # --8<-- [end:update_from_kv_xfer_finished]

    def _update_waiting_for_remote_kv(self, request: Request) -> None:
        """Its load finished: enter the loaded blocks in the prefix cache (or,
        after a failure, keep what loaded before the first bad block)."""
        if request.request_id in self.failed_recving_kv_req_ids:
            if request.num_computed_tokens:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            else:
                # Nothing usable: give the blocks back (a local hit may do better).
                self.kv_cache_manager.free(request)
            self.failed_recving_kv_req_ids.remove(request.request_id)
        else:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            # A whole prompt loaded: its last token runs again, for its logits.
            if request.num_computed_tokens == request.num_tokens:
                request.num_computed_tokens = request.num_tokens - 1
        self.finished_recving_kv_req_ids.remove(request.request_id)

    # --8<-- [start:handle_invalid_blocks]
    def _handle_invalid_blocks(
        self, invalid_block_ids: set[int], num_scheduled_tokens: dict[str, int]
    ) -> set[str]:
        """Requests that hold blocks which failed to load. Policy "recompute":
        each goes back to its first bad block and recomputes from there (the
        running ones are returned, so this step's sample is dropped). Policy
        "fail": all are returned, to be finished with an error. Under both,
        the bad blocks (and those after them) leave the prefix cache, so no
        later request hits them; vLLM evicts them under "fail" only, and under
        "recompute" a request admitted before the owner has recomputed them
        (a chunked recompute, or one not scheduled in that step) reads bad
        KV. The cost here: the recomputed blocks are not cached again by
        their owner, so the next request with that prefix computes it too."""
        # Asynchronous loads: their blocks are not cached yet, nothing to evict.
        async_load_reqs = [
            r for r in self.skipped_waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]
        async_failed, _ = self._update_requests_with_invalid_blocks(
            async_load_reqs, invalid_block_ids, num_scheduled_tokens, evict_blocks=False
        )
        sync_failed, blocks_to_evict = self._update_requests_with_invalid_blocks(
            self.running, invalid_block_ids, num_scheduled_tokens
        )
        if not async_failed and not sync_failed:
            return set()
        # Under both policies (vLLM evicts under "fail" only): a request
        # admitted before the owner has recomputed them would hit bad KV.
        self.kv_cache_manager.evict_blocks(blocks_to_evict)
        if not self.recompute_kv_load_failures:
            logger.error(
                "Failing %d request(s) after a KV load failure (kv_load_failure_policy=fail): %s",
                len(async_failed | sync_failed),
                sorted(async_failed | sync_failed),
            )
            return async_failed | sync_failed
        logger.warning(
            "Recomputing %d request(s) after a KV load failure (kv_load_failure_policy=recompute)",
            len(async_failed | sync_failed),
        )
        # Asynchronous ones resume when their load is reported finished.
        self.failed_recving_kv_req_ids |= async_failed
        return sync_failed

    def _update_requests_with_invalid_blocks(
        self,
        requests: Iterable[Request],
        invalid_block_ids: set[int],
        num_scheduled_tokens: dict[str, int],
        evict_blocks: bool = True,
    ) -> tuple[set[str], set[int]]:
        """Cut each affected request's num_computed_tokens back to its first
        invalid block. Returns the affected ids and the blocks to evict (the
        bad ones and every block after them). A bad block shared by two
        requests is recomputed by the first; the second counts only the
        tokens it had before this step. Only a request's first bad block is
        marked (as recomputed by it); vLLM marks every bad block the request
        holds, since it recomputes them all. Where two requests share two bad
        blocks, vLLM's second keeps its tokens, and here it goes back to the
        second of them: more recomputation, never less."""
        affected: set[str] = set()
        blocks_to_evict: set[int] = set()
        marked: set[int] = set()
        for request in requests:
            (req_block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)
            # Only blocks that may hold tokens computed before this step's run.
            num_computed_before = request.num_computed_tokens - num_scheduled_tokens.get(
                request.request_id, 0
            )
            num_blocks = -(-num_computed_before // self.block_size)
            is_affected = marked_here = False
            for idx, block_id in enumerate(req_block_ids[:num_blocks]):
                if block_id not in invalid_block_ids:
                    continue
                is_affected = True
                if block_id in marked or marked_here:
                    continue
                marked.add(block_id)
                marked_here = True
                request.num_computed_tokens = idx * self.block_size
                if evict_blocks:
                    blocks_to_evict.update(req_block_ids[idx:])
            if is_affected:
                if not marked_here:
                    request.num_computed_tokens = num_computed_before
                affected.add(request.request_id)
        return affected, blocks_to_evict

    # --8<-- [end:handle_invalid_blocks]

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running_reqs, num_waiting_reqs)"""
        return len(self.running), len(self.waiting) + len(self.skipped_waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.skipped_waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def only_waiting_for_grammars(self) -> bool:
        """Nothing to do until a grammar compiles (tracevllm's, for EngineCore.step_fn)."""
        return (
            not self.running
            and not self.waiting
            and not self.finished_req_ids
            and not self.finished_in_schedule
            and all(self._is_blocked_waiting_status(r.status) for r in self.skipped_waiting)
        )

    def only_waiting_for_remote_kvs(self) -> bool:
        """Nothing to do until a KV transfer finishes: no request to run, the
        blocked ones all loading (none whose load is in), or only finished
        requests whose blocks a remote reader holds (tracevllm's, for
        EngineCore.step_fn)."""
        return (
            self.connector is not None
            and self.only_waiting_for_grammars()
            and all(
                r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and r.request_id not in self.finished_recving_kv_req_ids
                for r in self.skipped_waiting
            )
        )

    def has_finished_requests(self) -> bool:
        if self.finished_req_ids:
            return True
        if self.connector is None:
            return False
        # Finished requests whose blocks a transfer still holds stay in
        # self.requests, out of the queues: the workers must keep stepping.
        num_in_queues = len(self.waiting) + len(self.skipped_waiting) + len(self.running)
        return len(self.requests) > num_in_queues

    def has_requests(self) -> bool:
        """Work left: unfinished requests, or finished ids the runner must see."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block. Only works when no request holds blocks,
        unless ``reset_running_requests`` preempts them all first."""
        if reset_running_requests:
            timestamp = time.monotonic()
            # From the back, so they return to waiting in their running order.
            while self.running:
                request = self.running.pop()
                self._preempt_request(request, timestamp)
                # Async scheduling: the outputs of its steps in flight are stale.
                request.async_tokens_to_discard = request.num_output_placeholders
                request.num_output_placeholders = 0
            self.prev_step_scheduled_req_ids.clear()
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        prefix_cache_stats = self.kv_cache_manager.make_prefix_cache_stats()
        assert prefix_cache_stats is not None
        block_pool = self.kv_cache_manager.block_pool
        connector_prefix_cache_stats = self.connector_prefix_cache_stats
        if connector_prefix_cache_stats is not None:
            self.connector_prefix_cache_stats = PrefixCacheStats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            # vLLM reports the skipped ones apart (num_skipped_waiting_reqs)
            # and adds them up for its waiting gauge.
            num_waiting_reqs=len(self.waiting) + len(self.skipped_waiting),
            step_counter=self.step_id,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=prefix_cache_stats,
            num_free_blocks=block_pool.get_num_free_blocks(),
            num_total_blocks=block_pool.get_num_usable_blocks(),
            num_cached_blocks=block_pool.num_cached_blocks,
            num_preempted_reqs=self.num_preempted_reqs,
            spec_decoding_stats=self.spec_decoding_stats,
            connector_prefix_cache_stats=connector_prefix_cache_stats,
            kv_connector_stats=(
                self.connector.get_kv_connector_stats() if self.connector is not None else None
            ),
        )

    def shutdown(self) -> None:
        """Shut the KV connector's scheduler side down (vLLM also closes its KV
        event publisher)."""
        if self.connector is not None:
            self.connector.shutdown()

    def get_kv_connector(self) -> KVConnectorBase_V1 | None:
        return self.connector
