"""Incremental detokenization and stop strings against the real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from tracevllm.engine import EngineCoreRequest
from tracevllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from tracevllm.sampling_params import SamplingParams


def _request(prompt_ids: list[int], **kwargs: Any) -> EngineCoreRequest:
    return EngineCoreRequest("r", prompt_ids, SamplingParams(**kwargs), 0.0)


@pytest.mark.parametrize(
    ("text", "new", "stop", "include", "expected"),
    [
        ("hello world", 5, ["wor"], False, ("wor", 6)),
        ("hello world", 5, ["wor"], True, ("wor", 9)),
        ("hello world", 3, ["world"], True, ("world", -1)),
        # Straddles the boundary between old and new text.
        ("hello world", 5, ["o w"], False, ("o w", 4)),
        # Already searched text is not searched again.
        ("stop here, then more", 4, ["stop"], False, None),
        ("abc", 0, ["a"], False, None),
    ],
)
def test_check_stop_strings(
    text: str, new: int, stop: list[str], include: bool, expected: tuple[str, int] | None
) -> None:
    assert check_stop_strings(text, new, stop, include) == expected


def test_incremental_text_equals_batch_decode(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Write a word:")
    text = " naïve café — 東京 🚀 done."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, _request(prompt))
    for token_id in ids:  # one token at a time, as the engine delivers them
        assert detok.update([token_id], stop_terminated=False) is None
    assert detok.output_text == tokenizer.decode(ids)
    assert detok.token_ids == ids


def test_stop_string_truncates_and_min_tokens_delays(tokenizer: Any) -> None:
    ids = tokenizer.encode(" one two three four")
    detok = IncrementalDetokenizer(tokenizer, _request([1], stop=[" three"]))
    hit = None
    for token_id in ids:
        hit = hit or detok.update([token_id], stop_terminated=False)
    assert hit == " three"
    assert detok.output_text == " one two"
    # With min_tokens covering the stop string's tokens, it cannot stop.
    detok = IncrementalDetokenizer(
        tokenizer, _request([1], stop=[" one"], min_tokens=3, max_tokens=16)
    )
    assert detok.update(ids, stop_terminated=False) is None


def test_stop_token_text_is_dropped_but_id_kept(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(" Paris.") + [eos]
    detok = IncrementalDetokenizer(tokenizer, _request([1], skip_special_tokens=False))
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == " Paris."
    assert detok.token_ids[-1] == eos


def test_streamed_text_holds_back_possible_stop_prefix(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, _request([1], stop=["STOP"]))
    detok.update(tokenizer.encode(" abc"), stop_terminated=False)
    # "STOP" is 4 chars: the last 3 are held back while running.
    assert detok.get_next_output_text(finished=False, delta=False) == detok.output_text[:-3]
    assert detok.get_next_output_text(finished=True, delta=False) == detok.output_text
