"""Incremental detokenization and stop strings, in the frontend process.

Mirrors vllm/v1/engine/detokenizer.py (``IncrementalDetokenizer``,
``check_stop_strings``). Only the fast-tokenizer path: the ``tokenizers``
library's ``DecodeStream`` turns one token at a time into text, holding back
bytes until they form valid UTF-8. Left out: the slow (pure-Python) path and
``spaces_between_special_tokens=False``.

Stop strings are found here, not in the engine core: the core only sees token
ids. When one matches, the output processor finishes the request and tells the
core to abort it, so its KV blocks are freed.

Departure: with speculative decoding a step brings several tokens, and a stop
string may be complete before the last of them. vLLM 0.22 keeps them all (the
text is cut, ``token_ids`` and the usage are not); tracevllm looks for stop
strings token by token then (``update_until_stop``) and drops the tokens after
the one that completed the stop string, so that greedy output with drafts is
token for token the output without, ids and usage included.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from tracevllm.engine import EngineCoreRequest
from tracevllm.labs import lab_hook


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        assert isinstance(params.stop, list)
        self.stop: list[str] = params.stop
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Characters held back from streamed text, so that a stop string is
        # never shown half-way before it is cut.
        self.stop_buffer_length = params.output_text_buffer_length
        self._last_output_text_offset = 0

        self.token_ids: list[int] = []
        self.output_text = ""
        self.detokenize = params.detokenize
        # The Rust tokenizer behind the HF fast tokenizer.
        self.tokenizer = tokenizer._tokenizer
        # Primed with the prompt so the first output token decodes in context
        # (a leading space, a multi-byte character begun in the prompt).
        self.stream = DecodeStream(
            ids=request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    # --8<-- [start:detokenizer_update]
    @lab_hook("update")  # lab 09: chapters/09-detokenizer
    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Detokenize new tokens, then look for stop strings.

        Returns the stop string that matched, or None.
        """
        if not new_token_ids:
            return None
        skipped_stop_token_id = None
        if stop_terminated and not self.include_stop_str_in_output:
            # EOS or a stop token ended it: its id is kept, its text is not.
            skipped_stop_token_id = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]

        stop_check_offset = len(self.output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            if self.detokenize:
                self.output_text += self.stream.step(self.tokenizer, token_id) or ""
            # Text produced before min_tokens is reached cannot stop the request.
            if self.min_tokens and self.num_output_tokens() <= self.min_tokens:
                stop_check_offset = len(self.output_text)
        if skipped_stop_token_id is not None:
            self.token_ids.append(skipped_stop_token_id)

        if not self.stop or self.num_output_tokens() <= self.min_tokens:
            return None
        match = check_stop_strings(
            self.output_text,
            new_char_count=len(self.output_text) - stop_check_offset,
            stop=self.stop,
            include_in_output=self.include_stop_str_in_output,
        )
        if match is None:
            return None
        stop_string, truncate_to = match
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_string

    # --8<-- [end:detokenizer_update]

    def update_until_stop(
        self, new_token_ids: list[int], stop_terminated: bool
    ) -> tuple[str | None, int]:
        """``update``, one token at a time when a step brought several and
        there are stop strings to look for (speculative decoding), stopping at
        the first token that completes one, as decoding one token per step
        would have.

        Returns the stop string that matched (or None) and how many of the
        new tokens were taken; the rest come after the stop and are dropped.
        """
        if len(new_token_ids) <= 1 or not self.stop:
            return self.update(new_token_ids, stop_terminated), len(new_token_ids)
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            # Only the step's last token can be the EOS or stop token that ended it.
            if stop_string := self.update([token_id], stop_terminated and i == last):
                return stop_string, i + 1
        return None, len(new_token_ids)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text so far (or since the last call, if ``delta``), minus the
        held-back tail while the request is still running."""
        buffer_length = 0 if finished else self.stop_buffer_length
        end = len(self.output_text) - buffer_length
        if not delta:
            return self.output_text[:end]
        start = self._last_output_text_offset
        if start >= end:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]


# --8<-- [start:check_stop_strings]
@lab_hook("check_stop_strings")  # lab 06: chapters/06-stop-strings
def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string in the newly added text.

    Returns (stop_string, truncate_to), truncate_to = -1 meaning keep all.
    Only the new characters (plus a stop string's length before them, for a
    match that straddles the boundary) are searched.
    """
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index == -1:
            continue
        if include_in_output:
            index += len(stop_str)
            if index >= len(output_text):
                return stop_str, -1
        return stop_str, index
    return None


# --8<-- [end:check_stop_strings]
