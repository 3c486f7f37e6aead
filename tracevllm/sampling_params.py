"""Sampling parameters for one request.

Mirrors vllm/sampling_params.py (``SamplingParams``, ``SamplingType``,
``RequestOutputKind``, ``StructuredOutputsParams``). Kept: n,
presence/frequency/repetition penalties, temperature, top_p, top_k, min_p,
seed, stop/stop_token_ids, ignore_eos, max_tokens/min_tokens, logprobs,
skip_special_tokens, include_stop_str_in_output, output_kind,
structured_outputs, logit_bias, extra_args. Left out: allowed/bad words, prompt logprobs,
beam search; of structured outputs, structural tags, Lark grammars and the
guidance/outlines backends. Like vLLM's, it is a msgspec Struct, so it
crosses the process boundary inside ``EngineCoreRequest`` as msgpack without
pickling.

Validation goes further than vLLM's: every field's type; every float as the
sampler will hold it, a float32 (vLLM checks the Python float, so a
temperature of 1e308 passes and becomes inf); a logit bias outside
[-100, 100] is refused (vLLM's ``from_optional`` clamps it).
"""

from __future__ import annotations

import copy
import math
import struct
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any

import msgspec

from tracevllm.exceptions import VLLMValidationError

if TYPE_CHECKING:
    from tracevllm.config import ModelConfig

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# Temperatures this small make logits / temperature overflow (vLLM's _MAX_TEMP).
_MAX_TEMP = 1e-2
# vLLM's VLLM_MAX_N_SEQUENCES default.
MAX_N_SEQUENCES = 16384
# What a msgpack integer on the wire carries (vLLM's OpenAI layer bounds seed
# the same way): a larger int would fail to encode after the request was accepted.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# The largest float32: the sampler's tensors are float32.
_FLOAT32_MAX = 3.4028234663852886e38
# OpenAI's bounds on a logit bias.
_MAX_LOGIT_BIAS = 100.0


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(Enum):
    # Every output carries all tokens so far.
    CUMULATIVE = 0
    # Every output carries only the new tokens.
    DELTA = 1
    # Only the finished request is returned (what LLM.generate uses).
    FINAL_ONLY = 2


class _TypeChecked:
    """What both structs share: every field checked against its annotation."""

    __slots__ = ()

    # --8<-- [start:verify_types]
    def _verify_types(self, prefix: str = "") -> None:
        """Check every field against its annotation, as the wire decoder will.

        The engine process decodes the request with msgspec against these same
        annotations; a value that passed here but failed there would be lost on
        the engine's input thread. So each field is converted here with
        ``msgspec.convert(strict=True)``: a bool is not an int, a float is not
        an int, a str is not a float. Beyond types: no NaN in any float, and
        every int within the signed 64-bit range that msgpack carries.
        (vLLM gets the type check from pydantic in its OpenAI layer and from
        ``_verify_args`` for a few fields; tracevllm checks all, in one place.)
        """
        assert isinstance(self, msgspec.Struct)
        for field in msgspec.structs.fields(self):
            if field.name.startswith("_"):
                continue  # set by the engine, not by the user
            name, value = prefix + field.name, getattr(self, field.name)
            try:
                if isinstance(field.type, type) and issubclass(field.type, Enum):
                    # convert() takes an enum's wire value, not a member.
                    if not isinstance(value, field.type):
                        raise msgspec.ValidationError(f"Expected `{field.type.__name__}`")
                else:
                    msgspec.convert(value, field.type, strict=True)
            except msgspec.ValidationError as e:
                raise TypeError(
                    f"{name} must be {_type_name(field.type)}, got "
                    f"{type(value).__name__} {value!r} ({e})."
                ) from None
            items = value if isinstance(value, list) else (value,)
            if isinstance(value, dict):
                items = [*value.keys(), *value.values()]
            for item in items:
                if isinstance(item, float) and math.isnan(item):
                    raise ValueError(f"{name} must be a number, got NaN.")
                if isinstance(item, int) and not _INT64_MIN <= item <= _INT64_MAX:
                    raise ValueError(
                        f"{name} must be within the signed 64-bit range "
                        f"[{_INT64_MIN}, {_INT64_MAX}], got {item}."
                    )

    # --8<-- [end:verify_types]


# --8<-- [start:structured_outputs_params]
class StructuredOutputsParams(_TypeChecked, msgspec.Struct, omit_defaults=True):  # type: ignore[call-arg]
    """One constraint on the output, enforced token by token (vLLM's).

    Exactly one of ``json`` (a JSON schema, as a dict or a string),
    ``regex``, ``choice``, ``grammar`` (EBNF/GBNF, as xgrammar reads it) and
    ``json_object`` (any JSON object). The engine compiles it with xgrammar
    against the tokenizer's vocabulary and masks every token that would
    break it. ``disable_any_whitespace`` allows no free whitespace in JSON,
    only xgrammar's one-line separators ``", "`` and ``": "`` (vLLM reads it
    from the engine's ``StructuredOutputsConfig`` only; tracevllm honours the
    request's). ``disable_additional_properties`` and ``whitespace_pattern``
    are the guidance/outlines backends' options: kept so a request written
    for vLLM decodes, refused with xgrammar (which has no such option).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self._verify_types("structured_outputs.")
        kinds = [name for name in CONSTRAINT_KINDS if getattr(self, name) is not None]
        if len(kinds) > 1:
            raise ValueError(
                f"structured_outputs: only one kind of constraint may be set, got "
                f"{' and '.join(kinds)}."
            )
        if not kinds:
            raise ValueError(
                "structured_outputs: one kind of constraint must be set: "
                f"{', '.join(CONSTRAINT_KINDS)}."
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice cannot be an empty list.")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("structured_outputs.grammar cannot be an empty string.")
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object must be True or unset, got False.")
        for name in ("disable_additional_properties", "whitespace_pattern"):
            if getattr(self, name) not in (False, None):
                raise ValueError(
                    f"structured_outputs.{name} is an option of vLLM's guidance and outlines "
                    "backends; tracevllm's xgrammar backend has no such option."
                )

    @property
    def kind(self) -> str | None:
        """The constraint set (``"json"``, ``"regex"`` ...), None if none is."""
        return next((name for name in CONSTRAINT_KINDS if getattr(self, name) is not None), None)

    def all_constraints_none(self) -> bool:
        return self.kind is None

    def __deepcopy__(self, memo: dict[int, Any]) -> StructuredOutputsParams:
        # tracevllm: SamplingParams.clone() shares the constraint, never
        # changed after the entry: a schema nested past Python's recursion
        # limit made deepcopy raise RecursionError before the entry's check.
        return copy.copy(self)


# The fields of StructuredOutputsParams that are constraints (the rest are
# options); public: a request's options are kept when the server replaces its
# constraint (tool calls), and vLLM spells these out wherever it needs them.
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# --8<-- [end:structured_outputs_params]


class SamplingParams(_TypeChecked, msgspec.Struct, omit_defaults=True, dict=True):  # type: ignore[call-arg]
    """Sampling parameters for text generation (OpenAI completions semantics).

    Validation happens here, at the entry point: a bad value raises
    ``ValueError`` naming the field and the allowed range, before the request
    reaches the engine.
    """

    n: int = 1
    # OpenAI's: subtracted from the logit of every token generated so far,
    # once (presence) or once per occurrence (frequency); in [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL's / HF's: > 1 makes every token of the prompt and output less
    # likely, < 1 more likely; 1 is off.
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1: no top-k (vLLM accepts both).
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # Token id -> added to its logit, in [-100, 100] (a logits processor).
    logit_bias: dict[int, float] | None = None
    # Arbitrary extras for custom components, as vLLM's; a KV connector reads
    # extra_args["kv_transfer_params"] (a dict) from a consumer's request.
    extra_args: dict[str, Any] | None = None
    # Characters held back from streamed text so a stop string is never shown
    # half-way (set from ``stop``).
    output_text_buffer_length: int = 0
    # Filled in by InputProcessor from the tokenizer / generation config.
    _eos_token_id: int | None = None
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)

    def __post_init__(self) -> None:
        # A tuple of stop strings is as good as a list (vLLM's pydantic layer
        # accepts any sequence); normalise before the types are checked.
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logprobs is True:
            self.logprobs = 1
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            # msgspec.convert would take a dict for the struct and leave it a dict.
            raise TypeError(
                f"structured_outputs must be StructuredOutputsParams or None, got "
                f"{type(so).__name__}."
            )
        self._verify_types()
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        self._verify_args()
        if 0 < self.temperature < _MAX_TEMP:
            self.temperature = _MAX_TEMP
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other knobs cannot matter, reset them as vLLM does.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        self._all_stop_token_ids.update(self.stop_token_ids)

    def _verify_args(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N_SEQUENCES:
            raise ValueError(f"n must be at most {MAX_N_SEQUENCES}, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        # vLLM lets infinity through these two; here it would turn logits into
        # NaN (logits / inf, -inf * inf), so they must be finite: as float32,
        # the sampler's dtype, where 1e308 is inf. The other floats have
        # ranges well inside float32.
        for name in ("temperature", "repetition_penalty"):
            value = getattr(self, name)
            if math.isinf(_float32(value)):
                raise VLLMValidationError(
                    f"{name} must be finite as a float32 (the sampler's dtype: at most "
                    f"{_FLOAT32_MAX:.7g}), got {value}.",
                    parameter=name,
                    value=value,
                )
        if _float32(self.repetition_penalty) == 0.0:
            # Positive logits are divided by it.
            raise VLLMValidationError(
                f"repetition_penalty must be greater than zero as a float32 (the sampler's "
                f"dtype: at least 1.4e-45), got {self.repetition_penalty}.",
                parameter="repetition_penalty",
                value=self.repetition_penalty,
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        so = self.structured_outputs
        if so is not None and so.choice and self.min_tokens:
            # tracevllm: a choice's text is at most one token per byte (xgrammar
            # never allows a token of no text), and once it is out the grammar
            # allows only a stop token, which min_tokens masks: past the
            # longest choice's bytes the request certainly allows no token.
            # Shorter cases depend on the tokens sampled (found in the engine).
            longest = max(len(c.encode("utf-8", "surrogatepass")) for c in so.choice)
            if self.min_tokens > longest:
                raise VLLMValidationError(
                    f"min_tokens={self.min_tokens} cannot be reached under "
                    f"structured_outputs.choice: the longest choice is {longest} bytes, so at "
                    f"most {longest} tokens, and after it only a stop token is allowed, which "
                    "min_tokens forbids until then.",
                    parameter="min_tokens",
                    value=self.min_tokens,
                )
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(
                f"logprobs must be non-negative or -1 (the whole vocabulary), got {self.logprobs}."
            )
        assert isinstance(self.stop_token_ids, list)
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (>= 0), got {self.stop_token_ids}.")
        assert isinstance(self.stop, list)
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")
        for token_id, bias in (self.logit_bias or {}).items():
            if not -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS:
                raise VLLMValidationError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}.",
                    parameter="logit_bias",
                    value=bias,
                )
        if self.temperature < _SAMPLING_EPS and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        kv_transfer_params = (self.extra_args or {}).get("kv_transfer_params")
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
            raise ValueError(
                "extra_args['kv_transfer_params'] must be a dict (a JSON object), got "
                f"{type(kv_transfer_params).__name__}."
            )

    def verify(self, model_config: ModelConfig) -> None:
        """The checks that need the model (vLLM's ``verify``), at the entry.

        Every field is checked again first: msgspec does not check assignments,
        so a field set after construction has not been seen yet.
        """
        self.__post_init__()
        vocab_size = model_config.vocab_size
        max_logprobs = model_config.max_logprobs
        if max_logprobs == -1:
            max_logprobs = vocab_size
        if self.logprobs:
            num_logprobs = vocab_size if self.logprobs == -1 else self.logprobs
            if num_logprobs > max_logprobs:
                raise ValueError(
                    f"Requested sample logprobs of {num_logprobs}, which is greater than "
                    f"max allowed: {max_logprobs} (logprobs; raise the engine's max_logprobs)."
                )
        assert self.stop_token_ids is not None
        if bad := [t for t in self.stop_token_ids if t >= vocab_size]:
            raise ValueError(
                f"stop_token_ids {bad} are out of the vocabulary: token ids must be in "
                f"[0, {vocab_size - 1}]."
            )
        self._validate_logit_bias(vocab_size)
        if self.structured_outputs is not None:
            self.structured_outputs.__post_init__()  # set after construction?
            # Compiled once here, without the tokenizer, so that a schema
            # xgrammar cannot take fails at the entry (vLLM's
            # _validate_structured_outputs).
            from tracevllm.structured_output.backend_xgrammar import validate_xgrammar_grammar

            validate_xgrammar_grammar(self)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def _validate_logit_bias(self, vocab_size: int) -> None:
        """Every biased token id in the vocabulary (vLLM's, with its message)."""
        if not self.logit_bias:
            return
        invalid_token_ids = [t for t in self.logit_bias if not 0 <= t < vocab_size]
        if invalid_token_ids:
            raise VLLMValidationError(
                f"token_id(s) {invalid_token_ids} in logit_bias contain out-of-vocab token "
                f"ids. Vocabulary size: {vocab_size}",
                parameter="logit_bias",
                value=invalid_token_ids,
            )

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    # --8<-- [start:update_from_generation_config]
    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_id: int | None = None
    ) -> None:
        """Take the model's stop tokens, as vLLM does.

        ``eos_token_id`` (the tokenizer's) stops the request unless
        ``ignore_eos``; it always joins ``all_stop_token_ids``, which is what
        ``min_tokens`` masks, so EOS is held back until ``min_tokens`` even
        under ``ignore_eos``. The generation config may name more EOS ids
        (Llama 3 instruct: ``<|eot_id|>``, ``<|eom_id|>``): they become stop
        token ids.
        """
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)
        if (eos_ids := generation_config.get("eos_token_id")) is not None:
            eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
            # The primary EOS stops through eos_token_id, not as a stop token.
            eos_ids.discard(eos_token_id)
            if eos_ids:
                self._all_stop_token_ids.update(eos_ids)
                if not self.ignore_eos:
                    assert self.stop_token_ids is not None
                    eos_ids.update(self.stop_token_ids)
                    self.stop_token_ids = sorted(eos_ids)

    # --8<-- [end:update_from_generation_config]

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (inf past its range, 0 below it)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _type_name(tp: Any) -> str:
    """``int``, ``int | None``, ``list[int] | None``: how an annotation reads."""
    return getattr(tp, "__name__", None) or str(tp).replace("NoneType", "None")
