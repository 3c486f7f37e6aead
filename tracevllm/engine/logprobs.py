"""Logprobs of generated tokens, turned into ``Logprob`` dicts in the frontend.

Mirrors vllm/v1/engine/logprobs.py (``LogprobsProcessor``); prompt logprobs
are left out. Each generated position gets a dict {token_id: Logprob} with the
sampled token and the top-``logprobs`` tokens, each with its rank and text.
"""

from __future__ import annotations

from typing import Any

from tracevllm.engine import EngineCoreRequest, LogprobsLists
from tracevllm.outputs import Logprob, SampleLogprobs


class LogprobsProcessor:
    def __init__(self, tokenizer: Any, request: EngineCoreRequest) -> None:
        self.tokenizer = tokenizer
        self.num_logprobs = request.sampling_params.logprobs
        self.logprobs: SampleLogprobs | None = [] if self.num_logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if self.num_logprobs is not None else None

    def update_from_output(self, new_logprobs: LogprobsLists | None) -> None:
        if self.logprobs is None or new_logprobs is None:
            return
        assert self.num_logprobs is not None and self.cumulative_logprob is not None
        for token_ids, logprobs, rank in zip(
            new_logprobs.logprob_token_ids, new_logprobs.logprobs, new_logprobs.sampled_token_ranks
        ):
            # Entry 0 is the sampled token; then the top-k, ranks 1..k
            # (logprobs=-1: k is the whole vocabulary).
            ranks = [rank, *range(1, len(token_ids))]
            position: dict[int, Logprob] = {}
            for token_id, logprob, r in zip(token_ids, logprobs, ranks):
                if token_id not in position:
                    text = self.tokenizer.decode([token_id])
                    position[token_id] = Logprob(logprob=logprob, rank=r, decoded_token=text)
            self.logprobs.append(position)
            self.cumulative_logprob += logprobs[0]
