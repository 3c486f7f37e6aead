"""Chat messages in, one prompt out: checked messages and the chat template.

Mirrors vllm/entrypoints/chat_utils.py (``parse_chat_messages``: each
message's content becomes text parts, a string being one part) and the chat
template step of vllm/renderers/hf.py (``safe_apply_chat_template``: a
template that fails, whatever it raises, is the request's error, a
``ValueError``). Text only: a content part must be ``{"type": "text", "text":
...}``; image, audio and video parts and reasoning fields are left out. Tool
use is kept: an assistant turn's ``tool_calls`` (their arguments parsed from
JSON, as vLLM's ``_postprocess_messages``), a tool turn's ``tool_call_id``,
and the request's ``tools``, all handed to the template. ``LLM.chat`` and the
OpenAI server's ``/v1/chat/completions`` both come through here, so both
refuse a bad message the same way, naming what is wrong.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from tracevllm.engine.input_processor import check_text
from tracevllm.exceptions import VLLMValidationError
from tracevllm.logger import init_logger

logger = init_logger(__name__)

# A message the template sees: {"role": ..., "content": ..., and for tool use
# "tool_calls" / "tool_call_id"} (vLLM's ConversationMessage).
ConversationMessage = dict[str, Any]


def make_tool_call_id() -> str:
    """A tool call's id (vLLM's default, "random", kind)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def parse_chat_messages(messages: Any) -> list[ConversationMessage]:
    """Check one conversation and make every content a plain string.

    ``content`` may be a string, a list of text parts (joined with newlines,
    as vLLM does for text-only templates) or, for an assistant turn, None.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a list of {'role': str, 'content': str} dicts, "
            f"got {type(messages).__name__}."
        )
    if not messages:
        raise ValueError("messages must hold at least one message.")
    conversation: list[ConversationMessage] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise TypeError(f"{where} must be a dict, got {type(message).__name__}.")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where} needs a 'role' (a non-empty str), got {role!r}.")
        check_text(role, f"{where}.role")
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        if "content" not in message and not tool_calls:
            raise ValueError(f"{where} ({role}) has no 'content'.")
        parsed: ConversationMessage = {
            "role": role,
            "content": _content_text(message.get("content"), where),
        }
        if tool_calls:
            parsed["tool_calls"] = _tool_calls(tool_calls, f"{where}.tool_calls")
        if role == "tool" and "tool_call_id" in message:
            parsed["tool_call_id"] = check_text(message["tool_call_id"], f"{where}.tool_call_id")
        conversation.append(parsed)
    return conversation


def _tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's tool calls, each function's arguments as a dict:
    what HF's tool-use templates expect (vLLM's ``_postprocess_messages``)."""
    if not isinstance(tool_calls, list):
        raise TypeError(f"{where} must be a list, got {type(tool_calls).__name__}.")
    calls = []
    for j, call in enumerate(tool_calls):
        call = call if isinstance(call, Mapping) else {}
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ValueError(
                f"{where}[{j}] must be {{'type': 'function', 'function': {{'name': str, "
                "'arguments': str}}}."
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            field = f"{where}[{j}].function.arguments"
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise VLLMValidationError(
                    f"{field} is not JSON: {e}.", parameter="messages"
                ) from None
            except RecursionError:
                # Python's parser recurses once per bracket: ~1000 deep is past its limit.
                raise VLLMValidationError(
                    f"{field} nests its JSON arrays and objects too deep for Python's parser.",
                    parameter="messages",
                ) from None
        calls.append({**call, "function": {**function, "arguments": arguments}})
    return calls


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return check_text(content, f"{where}.content")
    if not isinstance(content, list):
        raise TypeError(
            f"{where}.content must be a str or a list of text parts, got {type(content).__name__}."
        )
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(check_text(part, f"{where}.content[{j}]"))
            continue
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(
                f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': str}}; "
                f"tracevllm takes text only, got {kind!r}."
            )
        texts.append(check_text(part.get("text"), f"{where}.content[{j}].text"))
    return "\n".join(texts)


def apply_chat_template(
    tokenizer: Any,
    conversation: list[ConversationMessage],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """The prompt text and its token ids, through the model's chat template.

    The ids are the text's, encoded without special tokens: the template
    already wrote any it needs (a BOS added twice would change the output).
    A template that raises, whatever it raises (``raise_exception``, a
    ``ZeroDivisionError``, a missing key), makes a ``VLLMValidationError``
    naming ``chat_template`` if the request sent it, else ``messages`` (the
    model's template refused them).
    """
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "The model has no chat template (tokenizer_config.json 'chat_template'); "
            "pass chat_template=..., or send a plain prompt (generate / /v1/completions)."
        )
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs the last message to be an assistant's.")
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
        )
    except Exception as e:
        # vLLM's rule: logged in full, answered as the request's error.
        logger.warning("The chat template failed to render", exc_info=True)
        raise VLLMValidationError(
            f"The chat template failed to render: {type(e).__name__}: {e}",
            parameter="messages" if chat_template is None else "chat_template",
        ) from e
    return text, tokenizer.encode(text, add_special_tokens=False)
