"""Chat messages in, one prompt out: checked messages and the chat template.

Mirrors vllm/entrypoints/chat_utils.py (``parse_chat_messages``: each
message's content becomes text parts, a string being one part) and the chat
template step of vllm/renderers/hf.py (``safe_apply_chat_template``). Text
only: a content part must be ``{"type": "text", "text": ...}``; image, audio
and video parts, tools and reasoning fields are left out. ``LLM.chat`` and the
OpenAI server's ``/v1/chat/completions`` both come through here, so both
refuse a bad message the same way, naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tracevllm.engine.input_processor import check_text

# A message the template sees: {"role": ..., "content": ...} (vLLM's ConversationMessage).
ConversationMessage = dict[str, str]


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
        if "content" not in message:
            raise ValueError(f"{where} ({role}) has no 'content'.")
        conversation.append({"role": role, "content": _content_text(message["content"], where)})
    return conversation


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
) -> tuple[str, list[int]]:
    """The prompt text and its token ids, through the model's chat template.

    The ids are the text's, encoded without special tokens: the template
    already wrote any it needs (a BOS added twice would change the output).
    """
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "The model has no chat template (tokenizer_config.json 'chat_template'); "
            "pass chat_template=..., or send a plain prompt (generate / /v1/completions)."
        )
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs the last message to be an assistant's.")
    text = tokenizer.apply_chat_template(
        conversation,
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
    )
    return text, tokenizer.encode(text, add_special_tokens=False)
