"""Lab 06: stop strings. Your version of
``tracevllm.engine.detokenizer.check_stop_strings``.

Read README.md first. Test it with ``make lab CH=06``; watch it stop a real
request with ``TRACEVLLM_LAB=06`` and a stop string (see README.md).
"""

from __future__ import annotations


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string in the newly added text.

    Returns (stop_string, truncate_to), truncate_to = -1 meaning keep all.
    """
    # TODO 1: no new characters, or no stop strings: None.
    # TODO 2: for each stop string, in the order given, search output_text, but
    #         only from where a match could involve a new character: the new
    #         characters are the last new_char_count, and a match may begin up
    #         to len(stop_str) - 1 characters before them.
    # TODO 3: the first stop string found wins. truncate_to is where the output
    #         text must be cut: at the start of the match, or, with
    #         include_in_output, at its end (-1 if that is the end of the text).
    raise NotImplementedError("Lab 06: check_stop_strings (see chapters/06-stop-strings)")
