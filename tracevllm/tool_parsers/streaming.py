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
in one delta, and resumes the scan where the last delta ended
(``RequiredToolCallScanner``, one per choice): re-reading the whole reply at
each delta, as vLLM does, costs time quadratic in its length on the
server's event loop.
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
    sent: int | None = None  # where the arguments streamed so far end; None: not announced
    closed: bool = False  # its object is closed: nothing more can come of it


class RequiredToolCallScanner:
    """The calls of one streamed "required" reply, fed its text delta by delta.

    The scan resumes where the last delta ended, so a delta costs only its
    own characters (``scanned`` counts them); rescanning the whole reply at
    each delta cost time quadratic in its length, on the server's event
    loop. The text is kept (a call's name or parameters can begin in an
    earlier delta than the one that announces it). Depth 1 is the array,
    depth 2 a call object, whose members alternate between a key and its
    value; a value at depth 2 is a string or a number (ends at its quote, or
    at the next ``,``/``}``) or a container (ends when the depth comes back
    to 2).
    """

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[_CallSpan] = []
        self.scanned = 0  # characters the scan has gone through, in all
        self._depth = 0
        self._in_string = self._escaped = False
        # At depth 2: "key" -> "colon" -> "value_start" -> "value" -> "after".
        self._state = "key"
        self._key: object = None
        self._start = 0  # where the current key or value began
        self._unfinished = 0  # the calls before it are closed and streamed whole

    def feed(self, delta_text: str) -> DeltaMessage | None:
        """The tool-call pieces ``delta_text`` adds (None: none yet)."""
        begin = len(self.text)
        self.text += delta_text
        self._scan(begin)
        return self._deltas()

    def _end_value(self, end: int) -> None:
        value = self.text[self._start : end].rstrip()
        if self._key == "name" and value.startswith('"'):
            self.calls[-1].name = json.loads(value)
        elif self._key == "parameters":
            self.calls[-1].args_end = self._start + len(value)

    def _scan(self, begin: int) -> None:
        text = self.text
        self.scanned += len(text) - begin
        for i in range(begin, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 2 and self._state == "key":
                        self._key, self._state = json.loads(text[self._start : i + 1]), "colon"
                    elif self._depth == 2 and self._state == "value":
                        self._end_value(i + 1)
                        self._state = "after"
                continue
            if ch.isspace():
                continue
            if self._depth == 2 and self._state == "value_start":
                self._start, self._state = i, "value"
                if self._key == "parameters":
                    self.calls[-1].args_start = i
            if ch == '"':
                self._in_string = True
                if self._depth == 2 and self._state == "key":
                    self._start = i
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self.calls.append(_CallSpan())
                    self._state = "key"
            elif ch in "]}":
                if self._depth == 2 and self._state == "value":
                    self._end_value(i)  # a number, true, false or null, ended by the close
                if self._depth == 2:
                    self.calls[-1].closed = True
                self._depth -= 1
                if self._depth == 2 and self._state == "value":
                    self._end_value(i + 1)  # a container value closed
                    self._state = "after"
            elif self._depth == 2 and ch == ":":
                self._state = "value_start"
            elif self._depth == 2 and ch == ",":
                if self._state == "value":
                    self._end_value(i)
                self._state = "key"

    def _deltas(self) -> DeltaMessage | None:
        deltas = []
        for index in range(self._unfinished, len(self.calls)):
            call = self.calls[index]
            if call.name is None or call.args_start is None:
                continue  # not announced yet
            end = len(self.text) if call.args_end is None else call.args_end
            if call.sent is None:
                function = DeltaFunctionCall(
                    name=call.name, arguments=self.text[call.args_start : end]
                )
                deltas.append(
                    DeltaToolCall(
                        index=index, id=make_tool_call_id(), type="function", function=function
                    )
                )
                call.sent = end
            elif end > call.sent:
                function = DeltaFunctionCall(arguments=self.text[call.sent : end])
                deltas.append(DeltaToolCall(index=index, function=function))
                call.sent = end
        # Only the call being written can change: the ones before it are done.
        while self._unfinished < len(self.calls) and self._done(self.calls[self._unfinished]):
            self._unfinished += 1
        return DeltaMessage(tool_calls=deltas) if deltas else None

    @staticmethod
    def _done(call: _CallSpan) -> bool:
        if not call.closed:
            return False
        return call.sent is None or call.args_end is None or call.sent >= call.args_end


def extract_required_tool_call_streaming(
    previous_text: str, current_text: str
) -> DeltaMessage | None:
    """The tool-call pieces ``current_text`` adds to ``previous_text`` (None: none yet).

    vLLM's entry, stateless: it scans ``previous_text`` to learn what was
    sent, so a stream calls ``RequiredToolCallScanner.feed`` instead.
    """
    scanner = RequiredToolCallScanner()
    scanner.feed(previous_text)
    return scanner.feed(current_text[len(previous_text) :])
