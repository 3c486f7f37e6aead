"""Sampling parameters for one request.

Mirrors vllm/sampling_params.py (``SamplingParams``, ``SamplingType``,
``RequestOutputKind``). Kept: n, presence/frequency/repetition penalties,
temperature, top_p, top_k, min_p, seed, stop/stop_token_ids, ignore_eos,
max_tokens/min_tokens, logprobs, skip_special_tokens,
include_stop_str_in_output, output_kind. Left out: logit bias, allowed/bad
words, structured outputs, prompt logprobs, beam search. Like vLLM's, it is a
msgspec Struct, so it crosses the process boundary inside
``EngineCoreRequest`` as msgpack without pickling.
"""

from __future__ import annotations

import copy
from enum import Enum, IntEnum

import msgspec

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# Temperatures this small make logits / temperature overflow (vLLM's _MAX_TEMP).
_MAX_TEMP = 1e-2


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


class SamplingParams(msgspec.Struct, omit_defaults=True, dict=True):  # type: ignore[call-arg]
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
    # Characters held back from streamed text so a stop string is never shown
    # half-way (set from ``stop``).
    output_text_buffer_length: int = 0
    # Filled in by InputProcessor from the tokenizer / generation config.
    _eos_token_id: int | None = None
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logprobs is True:
            self.logprobs = 1
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
        if not isinstance(self.n, int) or isinstance(self.n, bool):
            raise ValueError(f"n must be an int, but is of type {type(self.n).__name__}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
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
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        assert isinstance(self.stop, list)
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")
        if self.temperature < _SAMPLING_EPS and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    def update_from_tokenizer(self, eos_token_id: int | None) -> None:
        """Record EOS; it stops generation unless ``ignore_eos`` (vLLM does this
        in ``update_from_generation_config`` / ``update_from_tokenizer``)."""
        self._eos_token_id = eos_token_id
        if eos_token_id is not None and not self.ignore_eos:
            self._all_stop_token_ids.add(eos_token_id)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
