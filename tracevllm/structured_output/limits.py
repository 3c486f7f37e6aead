"""What a user's constraint may be.

tracevllm's own: vLLM 0.22.0 hands a user's JSON schema, regex or grammar to
xgrammar as it comes. xgrammar parses and compiles it in C++, recursing once
per nesting level and per ``$ref`` it follows, and some shapes cost time that
grows much faster than their size. Measured with xgrammar 0.2.8 by
``benchmarks/bench_schema_limits.py --compile`` (each case in a child
process, on 2 CPU cores shared with other work):

- The stack. ``Grammar.from_json_schema`` on an 8 MiB thread stack (Linux's
  default) is killed by SIGSEGV on a chain of 16000 bare ``$ref``s (8000
  pass), or of 4000 objects each holding the next by ``$ref`` (1000 pass):
  the process that parses dies, be it the API server, the user's own or the
  engine. On a large stack both chains of 16000 pass.
- Nesting. The parse time grows with the cube of the depth: 64 nested
  objects 0.06 s, 128 0.5 s, 200 1.8 s (400: 16 s); 128 nested arrays
  0.14 s, 256 0.9 s.
- A ``pattern``'s repetition count: ``[a-z]{1000}`` parses in 0.05 s,
  ``{3000}`` in 0.5 s, ``{10000}`` in 12 s (a bare regex does not:
  ``a{100000}`` takes milliseconds).
- Size. The compilation against the vocabulary grows faster than the size:
  3500 properties (104 KB) 1.1 s, 10000 (390 KB) 8.5 s, 16000 objects
  chained by ``$ref`` 15.7 s. A ``$ref``'d definition is compiled once,
  however often it is used.

So ``check_json_schema`` walks a schema (a loop, never recursion: a schema
nested past Python's recursion limit is an ordinary input here) and refuses,
naming the field: more than ``MAX_JSON_SCHEMA_DEPTH`` (32) levels of JSON
objects and arrays (15 nested object schemas; OpenAI's structured outputs
allow 10), more than ``MAX_JSON_SCHEMA_REFS`` (1000) ``$ref``s, patterns whose
repetition counts add up past ``MAX_PATTERN_REPETITIONS`` (1000); and every
constraint (schema, regex, grammar, choice list) is at most
``MAX_CONSTRAINT_CHARS`` (64 KiB) of text. The worst schemas these allow,
measured the same way: 0.05 s to parse at the entry, 0.43 s to compile in
the engine (80 chains of 28 nested arrays), all on an 8 MiB stack.

And every parse or compile of a user's constraint runs on a thread with a
256 MiB stack all the same, for what the measurements did not try
(large_stack.py).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tracevllm.logger import init_logger
from tracevllm.structured_output.large_stack import run_with_large_stack

if TYPE_CHECKING:
    import xgrammar as xgr

logger = init_logger(__name__)

MAX_JSON_SCHEMA_DEPTH = 32
MAX_JSON_SCHEMA_REFS = 1000
MAX_PATTERN_REPETITIONS = 1000
MAX_CONSTRAINT_CHARS = 64 * 1024

# {n}, {n,} and {n,m} in a regex: the counts xgrammar unrolls.
_REPETITION = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_constraint_size(text: str, field: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"{field} is {len(text)} characters long; at most {MAX_CONSTRAINT_CHARS} are "
            "allowed (the time to compile a constraint grows faster than its size)."
        )


def _pattern_repetitions(pattern: str) -> int:
    """The repetition counts of a regex, added up (``a{3}b{2,5}``: 8)."""

    def count(digits: str) -> int:
        # int() of a 5000-digit string raises; past 9 digits is too many anyway.
        return int(digits) if len(digits) <= 9 else 10**9

    return sum(max(count(low), count(high or "0")) for low, high in _REPETITION.findall(pattern))


def walk_json(value: Any) -> Iterator[tuple[dict[str, Any] | list[Any], int]]:
    """Every JSON object and array in ``value`` with its depth (``value``'s is 1).

    A loop over an explicit stack, never recursion: a value nested past
    Python's recursion limit is just deep here (and a circular one is as
    deep as the caller lets the walk go).
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        yield node, depth
        stack.extend((child, depth + 1) for child in children)


# --8<-- [start:check_json_schema]
def check_json_schema(schema: str | dict[str, Any], field: str) -> tuple[dict[str, Any], str]:
    """The schema (parsed, if a string) and its text, once within the limits.

    Raises ``ValueError`` naming ``field`` and the limit it is past.
    """
    text = None
    if isinstance(schema, str):
        text = schema
        check_constraint_size(text, field)
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{field} is not valid JSON: {err}") from None
        except RecursionError:  # Python's own parser, on brackets nested ~1000 deep
            raise _too_deep(field) from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field} must be a JSON schema object, got {type(schema).__name__}.")
    num_refs = num_repetitions = 0
    for node, depth in walk_json(schema):
        if depth > MAX_JSON_SCHEMA_DEPTH:
            raise _too_deep(field)
        if not isinstance(node, dict):
            continue
        num_refs += "$ref" in node
        if num_refs > MAX_JSON_SCHEMA_REFS:
            raise ValueError(
                f"{field}: the schema has more than {MAX_JSON_SCHEMA_REFS} $refs, the most "
                "allowed (xgrammar follows each one recursively)."
            )
        if isinstance(pattern := node.get("pattern"), str):
            num_repetitions += _pattern_repetitions(pattern)
            if num_repetitions > MAX_PATTERN_REPETITIONS:
                raise ValueError(
                    f"{field}: the repetition counts ({{n}}, {{n,m}}) of the schema's patterns "
                    f"add up to more than {MAX_PATTERN_REPETITIONS}, the most allowed "
                    "(xgrammar's time grows with their square)."
                )
    if text is None:
        try:
            text = json.dumps(schema)  # what the engine compiles; the depth is bounded now
        except (TypeError, ValueError) as err:  # a set, an object, a circular list ...
            raise ValueError(f"{field} is not JSON: {err}") from None
        check_constraint_size(text, field)
    return schema, text


# --8<-- [end:check_json_schema]


def _too_deep(field: str) -> ValueError:
    return ValueError(
        f"{field}: the schema nests more than {MAX_JSON_SCHEMA_DEPTH} levels of JSON objects "
        f"and arrays, the most allowed (xgrammar's time grows with the cube of the depth)."
    )


# Compiling against 257 tokens costs at most ~0.1 s up to this size (the
# worst measured at 8 KiB); larger constraints that allow nothing are found
# at their first token instead (Scheduler._advance_grammar).
EMPTINESS_CHECK_MAX_CHARS = 8 * 1024
_byte_compiler: xgr.GrammarCompiler | None = None
_byte_compiler_lock = threading.Lock()


def allows_any_output(grammar: xgr.Grammar) -> bool:
    """Does the grammar's first mask allow a token, over the 256 bytes and a stop token?

    Any text, empty or not, begins with a byte or ends at once: a grammar
    whose first mask is empty matches nothing (``[^\\s\\S]``, ``{"$ref": "#"}``).
    """
    import xgrammar as xgr

    global _byte_compiler
    with _byte_compiler_lock:
        if _byte_compiler is None:
            vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[256])
            _byte_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiler = _byte_compiler
    try:
        compiled = run_with_large_stack(lambda: compiler.compile_grammar(grammar))
    except Exception:  # cannot tell here; the engine's compilation will say
        logger.warning("the byte-vocabulary compilation failed", exc_info=True)
        return True
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())
