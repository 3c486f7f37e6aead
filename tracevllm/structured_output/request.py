"""A request's structured-output state: its constraint and, once compiled, its matcher.

Mirrors vllm/v1/structured_output/request.py (``StructuredOutputRequest``,
``get_structured_output_key``). The grammar starts as a ``Future`` (compiled on
the manager's thread pool) and becomes the request's own ``XgrammarGrammar``
when the scheduler finds it done. Left out: the reasoning-parser fields
(structured output only after a model's reasoning ends).
"""

from __future__ import annotations

import functools
import json
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tracevllm.structured_output.backend_types import StructuredOutputKey, StructuredOutputOptions

if TYPE_CHECKING:
    from tracevllm.sampling_params import SamplingParams, StructuredOutputsParams
    from tracevllm.structured_output.backend_xgrammar import XgrammarGrammar


@dataclass
class StructuredOutputRequest:
    params: StructuredOutputsParams
    _grammar: Future[XgrammarGrammar] | XgrammarGrammar | None = None

    @staticmethod
    def from_sampling_params(
        sampling_params: SamplingParams | None,
    ) -> StructuredOutputRequest | None:
        if sampling_params is None:
            return None
        params = sampling_params.structured_outputs
        if params is None or params.all_constraints_none():
            return None
        return StructuredOutputRequest(params=params)

    def _check_grammar_completion(self) -> bool:
        """True once the grammar is compiled. A compilation that failed raises
        its exception here (vLLM leaves that case as a TODO)."""
        if isinstance(self._grammar, Future):
            if not self._grammar.done():
                return False
            self._grammar = self._grammar.result()
        return True

    @property
    def grammar(self) -> XgrammarGrammar | None:
        if not self._check_grammar_completion():
            return None
        assert not isinstance(self._grammar, Future)
        return self._grammar

    @grammar.setter
    def grammar(self, grammar: XgrammarGrammar | Future[XgrammarGrammar]) -> None:
        self._grammar = grammar

    @functools.cached_property
    def structured_output_key(self) -> StructuredOutputKey:
        return get_structured_output_key(self.params)


def get_structured_output_key(params: StructuredOutputsParams) -> StructuredOutputKey:
    """(kind, spec as a string): the same constraint gives the same key."""
    if params.json is not None:
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return StructuredOutputOptions.JSON, spec
    if params.json_object:
        return StructuredOutputOptions.JSON_OBJECT, ""
    if params.regex is not None:
        return StructuredOutputOptions.REGEX, params.regex
    if params.choice is not None:
        return StructuredOutputOptions.CHOICE, json.dumps(params.choice)
    if params.grammar is not None:
        return StructuredOutputOptions.GRAMMAR, params.grammar
    raise ValueError("No valid structured output parameter found")
