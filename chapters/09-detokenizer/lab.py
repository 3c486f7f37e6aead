"""Lab 09: incremental detokenization. Your version of
``tracevllm.engine.detokenizer.IncrementalDetokenizer.update``.

Read README.md first. Test it with ``make lab CH=09``; watch it turn real
tokens into text with ``TRACEVLLM_LAB=09 make trace PROMPT="..."``.

It is written as a plain function whose first argument is the
``IncrementalDetokenizer``: the engine installs it as the method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: this file is loaded while that module is
    from tracevllm.engine.detokenizer import IncrementalDetokenizer


def update(
    self: IncrementalDetokenizer, new_token_ids: list[int], stop_terminated: bool
) -> str | None:
    """Detokenize new tokens, then look for stop strings.

    Returns the stop string that matched, or None.
    """
    # What self holds (set up by IncrementalDetokenizer.__init__):
    #   self.token_ids, self.output_text   the output so far: ids and text
    #   self.stream, self.tokenizer        self.stream.step(self.tokenizer, id)
    #                                      returns the text one more token adds
    #                                      (or None while a character is incomplete)
    #   self.detokenize                    False: keep ids, make no text
    #   self.stop, self.min_tokens, self.include_stop_str_in_output
    # TODO 1: no new tokens: nothing to do.
    # TODO 2: stop_terminated (the last id is EOS or a stop token) and the stop
    #         string is not to be included: keep that id, but not its text.
    # TODO 3: append each id to self.token_ids and its text to self.output_text.
    #         Remember where the text stood before this step: the stop-string
    #         search looks only at what is new. Text made while the request has
    #         at most self.min_tokens output tokens does not count as new.
    # TODO 4: no stop strings, or still no more than min_tokens outputs: None.
    # TODO 5: check_stop_strings(self.output_text, new_char_count, self.stop,
    #         self.include_stop_str_in_output). Reach it through the module
    #         (from tracevllm.engine import detokenizer, inside this function:
    #         that module is still being imported when this file is loaded).
    #         On a match, cut self.output_text (unless truncate_to is -1) and
    #         return the stop string.
    raise NotImplementedError("Lab 09: IncrementalDetokenizer.update (see chapters/09-detokenizer)")
