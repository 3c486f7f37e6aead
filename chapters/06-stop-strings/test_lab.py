"""Lab 06 tests: check_stop_strings, alone and on text streaming in."""

from __future__ import annotations

import pytest
from _labkit import load

check_stop_strings = load(__file__, "check_stop_strings")


@pytest.mark.parametrize(
    ("text", "new", "stop", "include", "expected"),
    [
        # Cut before the stop string, or after it.
        ("hello world", 5, ["wor"], False, ("wor", 6)),
        ("hello world", 5, ["wor"], True, ("wor", 9)),
        # Included and at the very end: nothing to cut.
        ("hello world", 3, ["world"], True, ("world", -1)),
        ("hello world", 3, ["world"], False, ("world", 6)),
        # Straddles the boundary between old and new text.
        ("hello world", 5, ["o w"], False, ("o w", 4)),
        ("hello world", 1, ["o world"], False, ("o world", 4)),
    ],
)
def test_finds_the_stop_string(
    text: str, new: int, stop: list[str], include: bool, expected: tuple[str, int]
) -> None:
    assert check_stop_strings(text, new, stop, include) == expected


def test_nothing_to_find() -> None:
    assert check_stop_strings("hello world", 5, ["xyz"], False) is None
    assert check_stop_strings("hello world", 5, [], False) is None
    assert check_stop_strings("hello world", 0, ["world"], False) is None  # no new text
    # Still called, but "hello" lies wholly in text that was already searched.
    assert check_stop_strings("hello world", 5, ["hello"], False) is None
    assert check_stop_strings("hello world", 5, ["hello", "rld"], False) == ("rld", 8)


def test_old_text_is_not_searched_again() -> None:
    assert check_stop_strings("stop here, then more", 4, ["stop"], False) is None
    assert check_stop_strings("stop here, then stop", 4, ["stop"], False) == ("stop", 16)
    # The lookback is len(stop) - 1 characters: "xstop" + "!" cannot match "stop".
    assert check_stop_strings("xstop!", 1, ["stop"], False) is None


def test_the_first_stop_string_in_the_list_wins() -> None:
    text = "one two three"
    assert check_stop_strings(text, len(text), ["three", "one"], False) == ("three", 8)
    assert check_stop_strings(text, len(text), ["one", "three"], False) == ("one", 0)


def test_the_first_occurrence_is_cut() -> None:
    assert check_stop_strings("a.b.c.", 6, ["."], False) == (".", 1)
    assert check_stop_strings("a.b.c.", 6, ["."], True) == (".", 2)


@pytest.mark.parametrize("include", [False, True])
def test_streaming(include: bool) -> None:
    """Text arrives a few characters per step, as the detokenizer produces it;
    the stop string is split across steps."""
    pieces = ["The ans", "wer is 4", "2.\nEN", "D of text", " more"]
    text, steps = "", []
    for piece in pieces:
        text += piece
        match = check_stop_strings(text, len(piece), ["\nEND", "42!"], include)
        steps.append(match)
        if match is not None:
            break
    assert steps[:3] == [None, None, None]
    stop_string, truncate_to = steps[3]  # "\nEN" + "D": found in the 4th piece
    assert stop_string == "\nEND"
    final = text[:truncate_to] if truncate_to != -1 else text
    assert final == ("The answer is 42.\nEND" if include else "The answer is 42.")
