"""xgrammar, the structured-output backend: compile a constraint, match tokens.

Mirrors vllm/v1/structured_output/backend_xgrammar.py (``XgrammarBackend``,
``XgrammarGrammar``, ``has_xgrammar_unsupported_json_features``,
``validate_xgrammar_grammar``). A constraint is compiled once against the
tokenizer's vocabulary (``GrammarCompiler``, from ``TokenizerInfo``); each
request then gets its own ``GrammarMatcher``, the automaton's position, which
fills one row of the token bitmask per step and accepts each sampled token.
Compiled grammars are cached by xgrammar's compiler, as vLLM's, within
``TRACEVLLM_XGRAMMAR_CACHE_MB`` (vLLM's ``VLLM_XGRAMMAR_CACHE_MB``, 512 MiB).
Departures: tracevllm also keeps the compilations in flight by key, so the
``n`` children of one request wait for one compilation and a trace says a
request joined one; choice lists reach the backend as ``CHOICE`` (vLLM turns
them into an EBNF grammar at the entry; tracevllm at compile time, so the
trace still says "choice"); ``disable_any_whitespace`` is the request's
(vLLM: the engine's config). A user's constraint meets tracevllm's limits at
the entry, and xgrammar parses and compiles it on a thread with a large
stack (large_stack.py: vLLM's segfaults on a long ``$ref`` chain); the entry also
refuses a (small) constraint that allows no output at all, and
``has_xgrammar_unsupported_json_features`` walks the schema in a loop, not
by recursion.
Left out: Mistral tokenizers, structural tags, Lark grammars, the rollback
depth (``max_rollback_tokens``: unlimited since xgrammar 0.2, which drafts
use).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracevllm import envs
from tracevllm.structured_output.backend_types import StructuredOutputKey, StructuredOutputOptions
from tracevllm.structured_output.large_stack import run_with_large_stack
from tracevllm.structured_output.limits import (
    EMPTINESS_CHECK_MAX_CHARS,
    allows_any_output,
    check_constraint_size,
    check_json_schema,
    walk_json,
)
from tracevllm.structured_output.utils import choice_as_grammar

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from tracevllm.sampling_params import SamplingParams


class XgrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        # The vocabulary as xgrammar sees it: every token's bytes, once. A
        # padded embedding (vocab_size > len(tokenizer)) gets rows that the
        # matcher never allows.
        tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # The compiled grammars, least recently used dropped past the limit.
        self.compiler = xgr.GrammarCompiler(
            tokenizer_info,
            max_threads=8,
            cache_enabled=True,
            cache_limit_bytes=envs.TRACEVLLM_XGRAMMAR_CACHE_MB * 1024 * 1024,
        )
        # tracevllm: the compilations under way, by key (gone once done).
        self._compiling: dict[tuple[StructuredOutputKey, bool], Future[xgr.CompiledGrammar]]
        self._compiling = {}
        self._lock = threading.Lock()

    # --8<-- [start:compile_grammar]
    def compile_grammar(
        self, request_type: StructuredOutputOptions, grammar_spec: str, any_whitespace: bool = True
    ) -> XgrammarGrammar:
        """A fresh matcher for a constraint, from the compiler's cache.

        The first caller compiles (or finds it in xgrammar's cache); a caller
        with the same key meanwhile (the children of an ``n > 1`` request)
        waits for that compilation.
        """
        import xgrammar as xgr

        key = ((request_type, grammar_spec), any_whitespace)
        with self._lock:
            future = self._compiling.get(key)
            joined = future is not None
            if future is None:
                future = self._compiling[key] = Future()
        if not joined:
            try:
                future.set_result(self._compile(request_type, grammar_spec, any_whitespace))
            except Exception as e:
                future.set_exception(e)
            finally:
                with self._lock:
                    del self._compiling[key]
        ctx = future.result()
        return XgrammarGrammar(
            matcher=xgr.GrammarMatcher(ctx),
            vocab_size=self.vocab_size,
            joined=joined,
            compiler_cache_bytes=self.compiler.get_cache_size_bytes(),
        )

    def _compile(
        self, request_type: StructuredOutputOptions, spec: str, any_whitespace: bool
    ) -> xgr.CompiledGrammar:
        # On a thread with a large stack (in place on the grammar pool's):
        # xgrammar recurses in C++ (large_stack.py).
        compiler = self.compiler
        if request_type == StructuredOutputOptions.JSON:
            return run_with_large_stack(
                lambda: compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
            )
        if request_type == StructuredOutputOptions.JSON_OBJECT:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if request_type == StructuredOutputOptions.REGEX:
            return run_with_large_stack(lambda: compiler.compile_regex(spec))
        if request_type == StructuredOutputOptions.CHOICE:
            grammar = choice_as_grammar(json.loads(spec))
            return run_with_large_stack(lambda: compiler.compile_grammar(grammar))
        if request_type == StructuredOutputOptions.GRAMMAR:
            return run_with_large_stack(lambda: compiler.compile_grammar(spec))
        raise ValueError(f"grammar is not of valid supported types. ({request_type!s})")

    # --8<-- [end:compile_grammar]

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """[max_num_seqs, ceil(vocab_size / 32)] int32, all bits set."""
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self) -> None:
        del self.compiler


@dataclass
class XgrammarGrammar:
    """One request's matcher: where it stands in its compiled grammar."""

    vocab_size: int
    matcher: xgr.GrammarMatcher = field(repr=False)
    # tracevllm, for the trace: it waited for another request's compilation
    # of the same key; the compiler's cache size after (bytes).
    joined: bool = False
    compiler_cache_bytes: int = 0
    num_processed_tokens: int = field(default=0, init=False)
    _is_terminated: bool = field(default=False, repr=False, init=False)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by each token; False if the grammar refuses one (or has ended)."""
        if self._is_terminated:
            return False
        for token in tokens:
            if not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        self._is_terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts, without advancing."""
        accepted: list[int] = []
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens
        self._is_terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        """Row ``idx`` of ``bitmask``: bit t set iff token t may come next."""
        self.matcher.fill_next_token_bitmask(bitmask, idx)

    def is_terminated(self) -> bool:
        return self._is_terminated


# What xgrammar's JSON-schema converter supports (vLLM's list, from xgrammar's
# json_schema_converter.cc).
STRING_SUPPORTED_FORMATS = {
    "email",
    "date",
    "time",
    "date-time",
    "duration",
    "ipv4",
    "ipv6",
    "hostname",
    "uuid",
    "uri",
    "uri-reference",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
}


def has_xgrammar_unsupported_json_features(schema: dict[str, Any]) -> bool:
    """Keywords xgrammar would silently ignore (vLLM refuses them the same way).

    vLLM recurses into the schema; tracevllm walks it in a loop (``walk_json``),
    so that a schema nested past Python's recursion limit is refused for its
    depth, not with a ``RecursionError``.
    """

    def unsupported(obj: dict[str, Any]) -> bool:
        kind = obj.get("type")
        if kind in ("integer", "number") and "multipleOf" in obj:
            return True
        if kind == "array" and any(
            k in obj for k in ("uniqueItems", "contains", "minContains", "maxContains")
        ):
            return True
        if kind == "string" and "format" in obj:
            fmt = obj["format"]  # a list here would make vLLM's `in` raise TypeError
            return not isinstance(fmt, str) or fmt not in STRING_SUPPORTED_FORMATS
        return kind == "object" and any(k in obj for k in ("patternProperties", "propertyNames"))

    return any(isinstance(node, dict) and unsupported(node) for node, _ in walk_json(schema))


def xgrammar_reason(err: BaseException) -> str:
    """xgrammar's message without its C++ prefix ('[12:00:00] /project/cpp/x.cc:83: ')."""
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(err)).strip()


_WHAT = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "EBNF grammar",
}


# --8<-- [start:validate_xgrammar_grammar]
def validate_xgrammar_grammar(sampling_params: SamplingParams) -> None:
    """Refuse, at the entry, a constraint xgrammar cannot compile.

    First tracevllm's limits (limits.py: size, and a schema's depth, ``$ref``s
    and pattern repetitions), which keep xgrammar's time and stack bounded;
    then the constraint is parsed into an xgrammar ``Grammar`` (no tokenizer
    needed, milliseconds), on a thread with a large stack. The error names
    the field and gives the limit or xgrammar's reason. A small constraint
    is also compiled against a vocabulary of the 256 bytes, to refuse one
    that allows no output at all (tracevllm's; vLLM would run it, and end it
    with an error at its first token).
    """
    import xgrammar as xgr

    so_params = sampling_params.structured_outputs
    name = so_params.kind if so_params is not None else None
    if so_params is None or name is None or name == "json_object":
        return
    field = f"structured_outputs.{name}"
    what = _WHAT[name]
    parse: Callable[[], xgr.Grammar]
    if so_params.json is not None:
        schema, text = check_json_schema(so_params.json, field)
        if has_xgrammar_unsupported_json_features(schema):
            raise ValueError(
                f"{field}: the JSON schema uses features xgrammar does not support "
                "(multipleOf, uniqueItems, contains, patternProperties, propertyNames, "
                "or a string format it does not know)."
            )
        parse = functools.partial(xgr.Grammar.from_json_schema, text)
    elif so_params.regex is not None:
        text = so_params.regex
        parse = functools.partial(xgr.Grammar.from_regex, text)
    else:
        if so_params.choice is not None:
            text = choice_as_grammar(so_params.choice)
        else:
            assert so_params.grammar is not None
            text = so_params.grammar
        parse = functools.partial(xgr.Grammar.from_ebnf, text)
    check_constraint_size(text, field)
    try:
        grammar = run_with_large_stack(parse)
    except Exception as err:
        raise ValueError(
            f"{field}: xgrammar cannot compile this {what}: {xgrammar_reason(err)}"
        ) from None
    if len(text) <= EMPTINESS_CHECK_MAX_CHARS and not allows_any_output(grammar):
        raise ValueError(
            f"{field}: this {what} allows no output at all (no text matches it, not even "
            "an empty one), so no token could ever be sampled."
        )


# --8<-- [end:validate_xgrammar_grammar]
