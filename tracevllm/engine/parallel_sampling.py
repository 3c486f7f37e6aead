"""``n`` > 1: one parent request fanned out into ``n`` child requests.

Mirrors vllm/v1/engine/parallel_sampling.py (``ParentRequest``). The engine
core only ever sees n=1 requests; the children share the prompt (so the prefix
cache serves all but the first), and the frontend gathers their completions
back into one ``RequestOutput``.
"""

from __future__ import annotations

import copy

from tracevllm.engine import EngineCoreRequest
from tracevllm.metrics.stats import IterationStats
from tracevllm.outputs import CompletionOutput
from tracevllm.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    def __init__(self, request: EngineCoreRequest) -> None:
        assert request.external_req_id is not None
        self.request_id = request.request_id
        self.external_req_id = request.external_req_id
        self.sampling_params = request.sampling_params
        self.n = self.sampling_params.n
        self.child_requests: set[str] = set()
        self.output_aggregator: list[CompletionOutput | None] = [None] * self.n
        # The longest child so far, for vllm:request_max_num_generation_tokens.
        self.max_num_generation_tokens = 0

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """The child's request id and its own params (n=1; seed+index if seeded,
        so that the children differ but stay reproducible)."""
        child_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_id)
        params = self.sampling_params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed += index
        return child_id, params

    def child_request(self, request: EngineCoreRequest, index: int) -> EngineCoreRequest:
        """The ``index``-th child: a copy of the parent's request under its own
        id and params (vLLM writes this loop out in both engines)."""
        child_id, child_params = self.get_child_info(index)
        child = copy.copy(request)
        child.request_id = child_id
        child.sampling_params = child_params
        return child

    def get_outputs(
        self, child_request_id: str, completion: CompletionOutput
    ) -> tuple[list[CompletionOutput], bool]:
        """What to return for one child's new output, and whether the parent is finished.

        Streaming (CUMULATIVE, DELTA): the child's output right away, under the
        parent's id; the parent is finished once every child is. FINAL_ONLY:
        nothing until the last child finishes, then all n completions.
        """
        if completion.finished():
            self.child_requests.discard(child_request_id)
        finished = not self.child_requests
        if self.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            return [completion], finished
        self.output_aggregator[completion.index] = completion
        if not finished:
            return [], False
        return [c for c in self.output_aggregator if c is not None], True

    def observe_num_generation_tokens(self, num_generation_tokens: int) -> int:
        self.max_num_generation_tokens = max(num_generation_tokens, self.max_num_generation_tokens)
        return self.max_num_generation_tokens

    @staticmethod
    def observe_finished_request(
        parent_req: ParentRequest | None,
        iteration_stats: IterationStats,
        num_generation_tokens: int,
    ) -> None:
        """A child (or an n=1 request) finished: once the whole user request
        has, record its n and its longest child's token count."""
        n_param = parent_req.n if parent_req is not None else 1
        if parent_req is not None:
            num_generation_tokens = parent_req.observe_num_generation_tokens(num_generation_tokens)
        if parent_req is None or not parent_req.child_requests:
            iteration_stats.max_num_generation_tokens_iter.append(num_generation_tokens)
            iteration_stats.n_params_iter.append(n_param)
