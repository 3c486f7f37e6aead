"""Lab 09 tests: IncrementalDetokenizer.update with the default model's
tokenizer, on text whose characters are split across tokens."""

from __future__ import annotations

import types
from types import SimpleNamespace
from typing import Any

import pytest
from _labkit import load

from tracevllm.engine.detokenizer import IncrementalDetokenizer

update = load(__file__, "update")
TEXT = " Héllo wörld 😀 日本語 — done."


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from tracevllm.model_executor.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None))


def make(tokenizer: Any, **params: Any) -> tuple[IncrementalDetokenizer, list[int]]:
    """A detokenizer for a short prompt whose function under test is plugged
    in, and the ids of TEXT (the emoji and the CJK characters are split)."""
    sampling = {
        "stop": [],
        "min_tokens": 0,
        "include_stop_str_in_output": False,
        "output_text_buffer_length": 0,
        "detokenize": True,
        "skip_special_tokens": True,
        **params,
    }
    request = SimpleNamespace(
        sampling_params=SimpleNamespace(**sampling),
        prompt_token_ids=tokenizer.encode("Say something:"),
    )
    detok = IncrementalDetokenizer(tokenizer, request)  # type: ignore[arg-type]
    detok.update = types.MethodType(update, detok)  # type: ignore[method-assign]
    return detok, tokenizer.encode(TEXT)


def feed(detok: IncrementalDetokenizer, ids: list[int], per_step: int = 1) -> list[Any]:
    """One update per step, until a stop string ends the request."""
    results = []
    for i in range(0, len(ids), per_step):
        results.append(detok.update(ids[i : i + per_step], False))
        if results[-1] is not None:
            break
    return results


@pytest.mark.parametrize("per_step", [1, 2, 5])
def test_the_text_is_the_whole_decode(tokenizer: Any, per_step: int) -> None:
    detok, ids = make(tokenizer)
    assert feed(detok, ids, per_step) == [None] * len(range(0, len(ids), per_step))
    assert detok.output_text == TEXT, f"{per_step} token(s) per step"
    assert detok.token_ids == ids


def test_half_a_character_is_never_shown(tokenizer: Any) -> None:
    detok, ids = make(tokenizer)
    texts = []
    for token in ids:
        detok.update([token], False)
        texts.append(detok.output_text)
    assert all("\ufffd" not in t for t in texts), texts
    assert all(TEXT.startswith(t) for t in texts), texts
    assert texts[-1] == TEXT


def test_no_new_tokens_changes_nothing(tokenizer: Any) -> None:
    detok, ids = make(tokenizer, stop=["l"])
    feed(detok, ids[:2])
    before = (detok.output_text, list(detok.token_ids))
    assert detok.update([], False) is None
    assert (detok.output_text, detok.token_ids) == before
    assert before[1] == ids[:2]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_keeps_its_id_but_not_its_text(tokenizer: Any, include: bool) -> None:
    detok, ids = make(tokenizer, skip_special_tokens=False, include_stop_str_in_output=include)
    eos = tokenizer.eos_token_id
    feed(detok, ids[:3])
    assert detok.update([ids[3], eos], stop_terminated=True) is None
    assert detok.token_ids == [*ids[:4], eos]
    eos_text = tokenizer.decode([eos])
    expected = " Héllo w" + (eos_text if include else "")
    assert detok.output_text == expected


def test_a_stop_string_split_across_tokens(tokenizer: Any) -> None:
    detok, ids = make(tokenizer, stop=["wörld"])
    results = feed(detok, ids)
    assert results == [None] * 5 + ["wörld"]  # " w" + "ör" + "ld": whole at the 6th token
    assert detok.output_text == " Héllo "


def test_include_the_stop_string(tokenizer: Any) -> None:
    detok, ids = make(tokenizer, stop=["wörld"], include_stop_str_in_output=True)
    assert feed(detok, ids)[5] == "wörld"
    assert detok.output_text == " Héllo wörld"


def test_min_tokens_text_cannot_stop(tokenizer: Any) -> None:
    # "l" first appears in the 3rd token ("llo"), then in the 6th ("ld").
    detok, ids = make(tokenizer, stop=["l"])
    assert feed(detok, ids) == [None, None, "l"]
    assert detok.output_text == " Hé"
    detok, ids = make(tokenizer, stop=["l"], min_tokens=3)
    assert feed(detok, ids) == [None] * 5 + ["l"]
    assert detok.output_text == " Héllo wör"


def test_no_text_without_detokenize(tokenizer: Any) -> None:
    detok, ids = make(tokenizer, detokenize=False)
    feed(detok, ids)
    assert detok.token_ids == ids and detok.output_text == ""
