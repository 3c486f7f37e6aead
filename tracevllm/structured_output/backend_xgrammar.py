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
(vLLM: the engine's config).
Left out: Mistral tokenizers, structural tags, Lark grammars, the rollback
depth (``max_rollback_tokens``: unlimited since xgrammar 0.2, which drafts
use).
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracevllm import envs
from tracevllm.structured_output.backend_types import StructuredOutputKey, StructuredOutputOptions
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
        if request_type == StructuredOutputOptions.JSON:
            return self.compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
        if request_type == StructuredOutputOptions.JSON_OBJECT:
            return self.compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=any_whitespace
            )
        if request_type == StructuredOutputOptions.REGEX:
            return self.compiler.compile_regex(spec)
        if request_type == StructuredOutputOptions.CHOICE:
            return self.compiler.compile_grammar(choice_as_grammar(json.loads(spec)))
        if request_type == StructuredOutputOptions.GRAMMAR:
            return self.compiler.compile_grammar(spec)
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
    """Keywords xgrammar would silently ignore (vLLM refuses them the same way)."""

    def check_object(obj: Any) -> bool:
        if not isinstance(obj, dict):
            return False
        kind = obj.get("type")
        if kind in ("integer", "number") and "multipleOf" in obj:
            return True
        if kind == "array" and any(
            k in obj for k in ("uniqueItems", "contains", "minContains", "maxContains")
        ):
            return True
        if kind == "string" and "format" in obj and obj["format"] not in STRING_SUPPORTED_FORMATS:
            return True
        if kind == "object" and any(k in obj for k in ("patternProperties", "propertyNames")):
            return True
        return any(
            check_object(item)
            for value in obj.values()
            for item in (value if isinstance(value, list) else [value])
        )

    return check_object(schema)


def xgrammar_reason(err: BaseException) -> str:
    """xgrammar's message without its C++ prefix ('[12:00:00] /project/cpp/x.cc:83: ')."""
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(err)).strip()


# --8<-- [start:validate_xgrammar_grammar]
def validate_xgrammar_grammar(sampling_params: SamplingParams) -> None:
    """Refuse, at the entry, a constraint xgrammar cannot compile.

    Each kind is parsed into an xgrammar ``Grammar`` (no tokenizer needed,
    milliseconds); the error names the field and gives xgrammar's reason.
    """
    import xgrammar as xgr

    so_params = sampling_params.structured_outputs
    if so_params is None:
        return

    def refuse(name: str, what: str, err: BaseException) -> ValueError:
        return ValueError(
            f"structured_outputs.{name}: xgrammar cannot compile this {what}: "
            f"{xgrammar_reason(err)}"
        )

    if so_params.regex is not None:
        try:
            xgr.Grammar.from_regex(so_params.regex)
        except Exception as err:
            raise refuse("regex", "regex", err) from None
    if so_params.choice is not None:
        try:
            xgr.Grammar.from_ebnf(choice_as_grammar(so_params.choice))
        except Exception as err:
            raise refuse("choice", "choice list", err) from None
    if so_params.json is not None:
        schema = so_params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
        if not isinstance(schema, dict):
            raise ValueError(
                "structured_outputs.json must be a JSON schema object, got "
                f"{type(schema).__name__}."
            )
        if has_xgrammar_unsupported_json_features(schema):
            raise ValueError(
                "structured_outputs.json: the JSON schema uses features xgrammar does not "
                "support (multipleOf, uniqueItems, contains, patternProperties, propertyNames, "
                "or a string format it does not know)."
            )
        try:
            xgr.Grammar.from_json_schema(json.dumps(schema))
        except Exception as err:
            raise refuse("json", "JSON schema", err) from None
    if so_params.grammar is not None:
        try:
            xgr.Grammar.from_ebnf(so_params.grammar)
        except Exception as err:
            raise refuse("grammar", "EBNF grammar", err) from None


# --8<-- [end:validate_xgrammar_grammar]
