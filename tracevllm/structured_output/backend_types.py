"""The kinds of structured output, and the key a compiled grammar is cached by.

Mirrors vllm/v1/structured_output/backend_types.py (``StructuredOutputOptions``,
``StructuredOutputKey``). Left out: the abstract ``StructuredOutputBackend`` and
``StructuredOutputGrammar`` that let vLLM swap xgrammar for guidance, outlines or
lm-format-enforcer; tracevllm has one backend, so backend_xgrammar.py's classes
stand alone. Also left out: structural tags.
"""

from __future__ import annotations

import enum


class StructuredOutputOptions(enum.Enum):
    JSON = enum.auto()
    JSON_OBJECT = enum.auto()
    REGEX = enum.auto()
    GRAMMAR = enum.auto()
    CHOICE = enum.auto()


# (kind, spec): the spec as a string (a schema or a choice list as JSON).
StructuredOutputKey = tuple[StructuredOutputOptions, str]
