"""How many drafts a step proposed and how many the target model accepted.

Mirrors vllm/v1/spec_decode/metrics.py (``SpecDecodingStats``, and the
figures ``SpecDecodingLogging`` logs). The scheduler fills one per step
and sends it inside ``SchedulerStats``; the frontend feeds it to the
Prometheus counters (metrics/loggers.py). Left out: the periodic log line
(tracevllm has no logging stat logger).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """One step's drafts, summed over the requests that had any."""

    num_spec_tokens: int
    # Requests that had drafts this step.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [num_spec_tokens]: how often draft position i was accepted.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(
            num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens
        )

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        assert num_accepted_tokens <= self.num_spec_tokens
        # Accepted drafts are a prefix: positions 0 .. num_accepted - 1.
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per step per request, the bonus token included (vLLM's convention)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
