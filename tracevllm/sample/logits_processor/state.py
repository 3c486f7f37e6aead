"""The batch's logits processors, split by whether greedy sampling feels them.

Mirrors vllm/v1/sample/logits_processor/state.py (``LogitsProcessors``).
Left out: ``BatchUpdateBuilder`` (see interface.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

from tracevllm.sample.logits_processor.interface import LogitsProcessor


class LogitsProcessors:
    """The sampler runs ``non_argmax_invariant`` before the penalties, on
    every row, and ``argmax_invariant`` after the temperature, on the rows
    that sample."""

    def __init__(self, logitsprocs: Iterable[LogitsProcessor] | None = None) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for processor in logitsprocs or ():
            if processor.is_argmax_invariant():
                self.argmax_invariant.append(processor)
            else:
                self.non_argmax_invariant.append(processor)

    @property
    def all(self) -> Iterator[LogitsProcessor]:
        return chain(self.argmax_invariant, self.non_argmax_invariant)
