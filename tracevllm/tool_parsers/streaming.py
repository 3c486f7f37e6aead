"""Forced tool calls, streamed: each delta of the constrained reply as tool-call pieces.

Mirrors vllm/tool_parsers/streaming.py (``extract_named_tool_call_streaming``,
``extract_required_tool_call_streaming``). A named function's reply is its
arguments, so each text delta is more of them. A ``"required"`` reply is a
JSON array of ``{"name": ..., "parameters": {...}}``; a call is announced
(id, type, name) once its name is whole and its parameters have begun, and
each later delta carries the new text of its parameters, raw, as the model
wrote it. vLLM re-parses the text with ``partial_json_parser`` and follows
the last call only; tracevllm scans the text itself (it is a valid JSON
prefix, the grammar saw to that), which also streams two calls that begin
in one delta.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tracevllm.entrypoints.chat_utils import make_tool_call_id
from tracevllm.entrypoints.openai.chat_completion.protocol import DeltaMessage
from tracevllm.entrypoints.openai.engine.protocol import DeltaFunctionCall, DeltaToolCall


def extract_named_tool_call_streaming(
    delta_text: str, function_name: str, function_name_returned: bool
) -> tuple[DeltaMessage, bool]:
    """A delta of a forced function's arguments; the first one names the call."""
    if function_name_returned:
        call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta_text))
    else:
        call = DeltaToolCall(
            index=0,
            id=make_tool_call_id(),
            type="function",
            function=DeltaFunctionCall(name=function_name, arguments=delta_text),
        )
    return DeltaMessage(tool_calls=[call]), True


@dataclass(slots=True)
class _CallSpan:
    """Where one call of a "required" reply's array stands in the text."""

    name: str | None = None  # once its string is closed
    args_start: int | None = None  # where its parameters' value begins
    args_end: int | None = None  # one past where it ends, once it has

    def arguments(self, text: str) -> str:
        assert self.args_start is not None
        return text[self.args_start : len(text) if self.args_end is None else self.args_end]


def _scan_tool_calls(text: str) -> list[_CallSpan]:
    """The calls begun in a (valid, maybe unfinished) JSON array of calls.

    Depth 1 is the array, depth 2 a call object, whose members alternate
    between a key and its value; a value at depth 2 is a string or a
    number (ends at its quote, or at the next ``,``/``}``) or a container
    (ends when the depth comes back to 2).
    """
    calls: list[_CallSpan] = []
    depth = 0
    in_string = escaped = False
    state = "key"  # at depth 2: "key" -> "colon" -> "value_start" -> "value" -> "after"
    key: object = None
    start = 0  # where the current key or value began

    def end_value(end: int) -> None:
        value = text[start:end].rstrip()
        if key == "name" and value.startswith('"'):
            calls[-1].name = json.loads(value)
        elif key == "parameters":
            calls[-1].args_end = start + len(value)

    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2 and state == "key":
                    key, state = json.loads(text[start : i + 1]), "colon"
                elif depth == 2 and state == "value":
                    end_value(i + 1)
                    state = "after"
            continue
        if ch.isspace():
            continue
        if depth == 2 and state == "value_start":
            start, state = i, "value"
            if key == "parameters":
                calls[-1].args_start = i
        if ch == '"':
            in_string = True
            if depth == 2 and state == "key":
                start = i
        elif ch in "[{":
            depth += 1
            if depth == 2:
                calls.append(_CallSpan())
                state = "key"
        elif ch in "]}":
            if depth == 2 and state == "value":
                end_value(i)  # a number, true, false or null, ended by the object's close
            depth -= 1
            if depth == 2 and state == "value":
                end_value(i + 1)  # a container value closed
                state = "after"
        elif depth == 2 and ch == ":":
            state = "value_start"
        elif depth == 2 and ch == ",":
            if state == "value":
                end_value(i)
            state = "key"
    return calls


def extract_required_tool_call_streaming(
    previous_text: str, current_text: str
) -> DeltaMessage | None:
    """The tool-call pieces ``current_text`` adds to ``previous_text`` (None: none yet)."""
    before = _scan_tool_calls(previous_text)
    deltas = []
    for index, call in enumerate(_scan_tool_calls(current_text)):
        if call.name is None or call.args_start is None:
            continue  # not announced yet
        sent = before[index] if index < len(before) else None
        announced = sent is not None and sent.name is not None and sent.args_start is not None
        new = call.arguments(current_text)
        if announced:
            assert sent is not None
            new = new[len(sent.arguments(previous_text)) :]
            if new:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=new)))
        else:
            deltas.append(
                DeltaToolCall(
                    index=index,
                    id=make_tool_call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=new),
                )
            )
    return DeltaMessage(tool_calls=deltas) if deltas else None
