"""What /v1/completions and /v1/chat/completions both take, and the checks
every request body passes before its fields are read.

tracevllm's own: vLLM writes these fields out in each request class
(vllm/entrypoints/openai/completion/protocol.py and
chat_completion/protocol.py, ``to_sampling_params``); tracevllm writes them
once. The checks, each so that a request is never served other than it asked:

- A string anywhere in the body that is not valid Unicode (a lone surrogate
  such as ``"\\ud800"``, which JSON can escape but UTF-8 cannot carry) is a
  400 naming where it is (vLLM fails later, in a codec).
- ``stream_options`` without ``stream``: vLLM's rule and message.
- A field tracevllm does not implement but that would change the output
  (beam search, ``allowed_token_ids``, vLLM's removed ``guided_*`` fields,
  ...) is a 400 naming it (``GenerateRequest.unsupported_fields``; each
  endpoint adds its own). vLLM implements them, or (the ``guided_*``
  fields, gone before 0.22.0) drops them with a debug line.
- ``logit_bias``'s keys must be token ids; SamplingParams checks the ids
  against the vocabulary and the values' range.
- ``kv_transfer_params`` that ask for a transfer (``do_remote_prefill`` or
  ``do_remote_decode`` true) with several prompts or ``n`` > 1 are a 400
  naming the field (``check_kv_transfer_params_single``). They name one
  prompt's blocks on one prefill engine: a prefill server would hold every
  prompt's and completion's blocks but return only the first's params, and a
  decode server would read the same blocks into each. Params that ask for
  nothing (``{"do_remote_decode": false}``) are served as the connector
  reads them: not at all. vLLM takes such a request (its disaggregation
  proxy sends one prompt with ``n`` = 1).
- On a prefill server (``kv_role`` ``kv_producer``), ``do_remote_decode``
  with ``max_tokens`` other than 1 is a 400 naming the field
  (``check_kv_transfer_params_producer``): the role says the server only
  computes prompts for decode servers (with the NixlConnector, a finished
  request's blocks are held for the reader, so a longer completion would
  only pin them longer), and vLLM's disaggregation proxy always sends 1.
  vLLM takes it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
from pydantic import model_validator

from tracevllm.engine.input_processor import check_text
from tracevllm.entrypoints.openai.engine.protocol import (
    OpenAIBaseModel,
    ResponseFormat,
    StreamOptions,
)
from tracevllm.exceptions import VLLMValidationError
from tracevllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from tracevllm.distributed.kv_transfer.kv_transfer_config import KVTransferConfig


def asks_for_kv_transfer(kv_transfer_params: dict[str, Any] | None) -> bool:
    """Whether ``kv_transfer_params`` ask a connector to do anything: read a
    prefill's blocks (``do_remote_prefill``) or hold them for a reader
    (``do_remote_decode``). The connectors act on these two flags' truth."""
    return bool(
        kv_transfer_params
        and (
            kv_transfer_params.get("do_remote_prefill")
            or kv_transfer_params.get("do_remote_decode")
        )
    )


def check_kv_transfer_params_single(
    kv_transfer_params: dict[str, Any] | None, num_prompts: int, n: int
) -> None:
    """A request whose ``kv_transfer_params`` ask for a transfer has one
    prompt and ``n`` = 1."""
    if not asks_for_kv_transfer(kv_transfer_params):
        return
    if num_prompts > 1 or n > 1:
        what = f"{num_prompts} prompts" if num_prompts > 1 else f"n = {n}"
        raise VLLMValidationError(
            "kv_transfer_params serves one prompt and one completion (a disaggregated "
            f"request is one prompt with n = 1), got {what}: send each prompt and "
            "completion as its own request.",
            parameter="kv_transfer_params",
        )


def check_kv_transfer_params_producer(
    kv_transfer_params: dict[str, Any] | None,
    max_tokens: int,
    kv_transfer_config: KVTransferConfig | None,
    parameter: str = "max_tokens",
) -> None:
    """On a prefill server (``kv_role`` ``kv_producer``, whatever its
    connector), a request with ``do_remote_decode`` asks for ``max_tokens`` =
    1 (``parameter``: the field that set it): the role says the server only
    computes prompts for decode servers. Not on ``kv_both`` (vLLM's
    ``is_kv_producer`` counts it), which also serves whole completions (the
    OffloadingConnector's role); there the NixlConnector itself holds blocks
    only for a request that generated at most one token."""
    if (
        kv_transfer_config is None
        or kv_transfer_config.kv_connector is None
        or kv_transfer_config.kv_role != "kv_producer"
        or not (kv_transfer_params and kv_transfer_params.get("do_remote_decode"))
        or max_tokens == 1
    ):
        return
    raise VLLMValidationError(
        f"kv_transfer_params with do_remote_decode on a prefill server (kv_role "
        f"kv_producer) needs {parameter} = 1, got {max_tokens}: a prefill server computes "
        "the prompt and its first token; the decode server generates the completion.",
        parameter=parameter,
    )


# vLLM's defaults when neither the request nor the model's generation config
# sets one (``_DEFAULT_SAMPLING_PARAMS`` in its request classes).
_DEFAULT_SAMPLING_PARAMS = {
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}

# vLLM's structured-output fields of old (removed before 0.22.0, which drops
# them unread): refused, so that an unconstrained answer is not served as if
# it were constrained.
_REMOVED_GUIDED = (
    "vLLM removed the guided_* fields; send structured_outputs (e.g. {'json': schema}) "
    "or response_format instead"
)
# A field tracevllm does not implement -> (the values that ask for nothing,
# why it is refused otherwise).
UnsupportedFields = dict[str, tuple[tuple[Any, ...], str]]
_UNSUPPORTED_FIELDS: UnsupportedFields = {
    "use_beam_search": ((False,), "beam search is not implemented"),
    "length_penalty": ((1, None), "it scores beams, and beam search is not implemented"),
    "allowed_token_ids": ((None,), "it is not implemented"),
    "bad_words": ((None, []), "it is not implemented"),
    "prompt_logprobs": ((None,), "prompt logprobs are not computed"),
    "truncate_prompt_tokens": ((None,), "prompts are not truncated; shorten the prompt"),
    "return_token_ids": ((None, False), "responses carry no token ids"),
    "return_tokens_as_token_ids": ((None, False), "logprobs' tokens are always text"),
    "repetition_detection": ((None,), "it is not implemented"),
    "thinking_token_budget": ((None,), "there are no reasoning parsers"),
    "logits_processors": ((None,), "custom logits processors are not taken"),
    "cache_salt": ((None,), "the prefix cache is not salted, so it would not isolate you"),
    **{
        name: ((None,), _REMOVED_GUIDED)
        for name in (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "guided_decoding_backend",
            "guided_whitespace_pattern",
        )
    },
}

_TOKEN_ID = re.compile(r"-?[0-9]+")


def _same(value: Any, allowed: Any) -> bool:
    # true is not 1, and 1 is not true, in a body.
    return bool(value == allowed) and isinstance(value, bool) == isinstance(allowed, bool)


def check_body_text(data: dict[str, Any]) -> None:
    """Every string in a request body, key or value, must be valid Unicode.

    JSON can escape a lone surrogate (``"\\ud800"``) that no UTF-8 text holds,
    and the tokenizer, a stop-string check or the response's encoder would
    fail on it later, with a codec's message. One walk, with an explicit
    stack (a deeply nested body must not exhaust Python's recursion limit),
    that passes over numbers without a look (a prompt of token ids can be
    long) and names the field, top level first, where it fails.
    """

    def check(text: str, name: str, field: str | None) -> None:
        if not text.isascii():  # ASCII (the common case) is valid as it is
            try:
                check_text(text, name)
            except ValueError as e:
                raise VLLMValidationError(str(e), parameter=field) from None

    # (the top-level field, the path to the value, the value)
    stack: list[tuple[str | None, str, Any]] = [(None, "", data)]
    while stack:
        field, path, value = stack.pop()
        if isinstance(value, str):
            check(value, path, field)
        elif isinstance(value, dict):
            for key, item in value.items():
                key_path = f"{path}.{key}" if path else str(key)
                if isinstance(key, str):
                    check(key, f"a key in {path}" if path else "a field's name", field)
                if isinstance(item, (str, dict, list)):
                    stack.append((field or str(key), key_path, item))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)):
                    stack.append((field, f"{path}[{i}]", item))


class GenerateRequest(OpenAIBaseModel):
    """The sampling fields /v1/completions and /v1/chat/completions share.

    vLLM writes them out in each request class; tracevllm writes them once.
    OpenAI's parameters first, then vLLM's extra ones (sent by the official
    client through ``extra_body``).
    """

    # Fields tracevllm does not implement (see the module's docstring); each
    # request class adds its own.
    unsupported_fields: ClassVar[UnsupportedFields] = _UNSUPPORTED_FIELDS

    model: str | None = None
    frequency_penalty: float | None = 0.0
    # Token id (as a string, JSON's keys) -> a bias in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = 0.0
    # OpenAI allows null (the default, 1); vLLM's completions refuse it.
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    # Structured outputs: vLLM's extra parameter, or OpenAI's response_format
    # ({"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}).
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    # --8<-- [start:request_checks]
    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        """What is refused before the fields are read: text that is not
        Unicode, ``stream_options`` without ``stream`` (vLLM's rule and
        message), and fields tracevllm does not implement."""
        if not isinstance(data, dict):
            return data  # pydantic refuses it, naming the body
        check_body_text(data)
        if data.get("stream_options") and not data.get("stream"):
            raise VLLMValidationError(
                "Stream options can only be defined when `stream=True`.",
                parameter="stream_options",
            )
        for name, (allowed, reason) in cls.unsupported_fields.items():
            if name in data and not any(_same(data[name], ok) for ok in allowed):
                raise VLLMValidationError(
                    f"{name} is not supported by tracevllm: {reason}.", parameter=name
                )
        return data

    @model_validator(mode="after")
    def _check_logit_bias(self) -> GenerateRequest:
        # JSON's keys are strings; the ids and the values' range are
        # SamplingParams' to check (against the vocabulary; OpenAI's [-100, 100]).
        for key in self.logit_bias or {}:
            if not _TOKEN_ID.fullmatch(key):
                raise VLLMValidationError(
                    f"logit_bias keys must be token ids written as integers, got {key!r}.",
                    parameter="logit_bias",
                )
        return self

    # --8<-- [end:request_checks]

    def sampling_kwargs(self, default_sampling_params: dict[str, object]) -> dict[str, object]:
        """SamplingParams keyword arguments; what the request leaves unset
        comes from the model's generation config, then vLLM's defaults."""
        kwargs: dict[str, object] = {}
        for name, default in _DEFAULT_SAMPLING_PARAMS.items():
            value = getattr(self, name)
            kwargs[name] = (
                value if value is not None else default_sampling_params.get(name, default)
            )
        if self.logit_bias:
            kwargs["logit_bias"] = {int(key): bias for key, bias in self.logit_bias.items()}
        return kwargs | dict(
            n=self.num_choices,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self._structured_outputs(),
        )

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """``structured_outputs``, with ``response_format``'s constraint laid over it.

        vLLM's rule (``to_sampling_params``: ``replace(structured_outputs,
        **response_format's)``): ``structured_outputs`` must hold a constraint
        of its own (a request with options only is refused, as vLLM's pydantic
        model refuses it); ``response_format`` then replaces a constraint of
        its own kind (``json`` for json_schema, ``json_object`` for
        json_object) and a constraint of another kind is a conflict: a 400.
        """
        so_params = None
        if self.structured_outputs is not None:
            try:
                so_params = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise TypeError(f"structured_outputs: {e}") from None
        fmt = self.response_format
        kwargs: dict[str, Any] = {}
        if fmt is not None and fmt.type == "json_object":
            kwargs["json_object"] = True
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError(
                    "When response_format type is 'json_schema', the 'json_schema' field "
                    "(with its 'schema') must be provided."
                )
            kwargs["json"] = fmt.json_schema.json_schema
        if not kwargs:
            return so_params
        if so_params is None:
            return StructuredOutputsParams(**kwargs)
        (new_kind,) = kwargs
        old_kind = so_params.kind
        if old_kind != new_kind:
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are "
                f"specified: response_format sets {new_kind!r} and structured_outputs sets "
                f"{old_kind!r}."
            )
        return msgspec.structs.replace(so_params, **kwargs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
