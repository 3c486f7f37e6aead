"""The scheduler for async scheduling: step N+1 is scheduled before step N's
tokens are known.

Mirrors vllm/v1/core/sched/async_scheduler.py (``AsyncScheduler``). With a
batch queue of two (``EngineCore.step_with_batch_queue``), the engine core
schedules the next step while the workers still run the last one. A decoding
request is scheduled again before its sampled token is back: that token is a
*placeholder*, counted in ``num_output_placeholders`` and in
``num_computed_tokens`` (its KV is written by the next step), but not in the
request's tokens. The worker fills the placeholder in: it feeds the token it
sampled last step as the next input (``ModelRunner._prepare_input_ids``).
When a step's output arrives, each token it brings replaces one placeholder.

A request that stops (EOS, a stop token) has one more step in flight by then:
that step's token is dropped when it arrives (the request is gone), and its
blocks were freed when it stopped. ``max_tokens`` is known in advance, so no
step is scheduled past it (``Scheduler.schedule``'s check). Left out:
speculative decoding's draft placeholders (tracevllm refuses drafts with
async scheduling, see ``VllmConfig._resolve_async_scheduling``).
"""

from __future__ import annotations

from tracevllm.core.sched.output import SchedulerOutput
from tracevllm.core.sched.scheduler import Scheduler
from tracevllm.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    # --8<-- [start:async_update_after_schedule]
    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Count one placeholder for each request that samples this step."""
        super()._update_after_schedule(scheduler_output)
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.is_prefill_chunk:
                continue  # its sample is thrown away: no token to wait for
            # A structured request with a token in flight: its grammar cannot
            # make this step's bitmask until that token is in.
            scheduler_output.pending_structured_output_tokens |= (
                request.use_structured_output and request.num_output_placeholders > 0
            )
            request.num_output_placeholders += 1 + len(spec_decode_tokens.get(req_id, ()))

    # --8<-- [end:async_update_after_schedule]

    # --8<-- [start:async_update_request_with_output]
    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """The sync path's append and stop check, then one placeholder less per
        token, and the blocks those tokens filled go to the prefix cache."""
        if request.async_tokens_to_discard > 0:
            # Preempted by reset_prefix_cache while this step was in flight.
            request.async_tokens_to_discard -= 1
            return [], False
        status_before_update = request.status
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids)
        request.num_output_placeholders -= len(new_token_ids)
        assert request.num_output_placeholders >= 0
        # allocate_slots cached only up to the known tokens; the ones that
        # just arrived may have filled a block. (A preempted request holds none.)
        if status_before_update == RequestStatus.RUNNING:
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders
            )
        return new_token_ids, stopped

    # --8<-- [end:async_update_request_with_output]
