"""SamplingParams validation: bad values fail at the entry, naming the field."""

from __future__ import annotations

import msgspec
import pytest

from tracevllm.sampling_params import SamplingParams, SamplingType


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"n": 2, "temperature": 0.0}, "n"),
        ({"logprobs": -2}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, stop="END", seed=-1)
    # Greedy resets the other knobs, as vLLM does.
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.stop == ["END"]
    assert p.seed is None
    assert p.sampling_type == SamplingType.GREEDY
    assert p.output_text_buffer_length == len("END") - 1
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(top_k=-1).top_k == -1


def test_eos_joins_stop_ids_unless_ignored() -> None:
    p = SamplingParams(stop_token_ids=[7])
    p.update_from_generation_config({}, 2)
    assert p.all_stop_token_ids == {2, 7} and p.eos_token_id == 2
    # ignore_eos: EOS no longer stops the request, but min_tokens still holds
    # it back, so it stays among the stop ids (as vLLM's).
    q = SamplingParams(stop_token_ids=[7], ignore_eos=True)
    q.update_from_generation_config({}, 2)
    assert q.all_stop_token_ids == {2, 7}
    assert q.eos_token_id is None


def test_generation_config_eos_ids_become_stop_ids() -> None:
    # Llama 3 instruct: eos_token_id in generation_config.json is a list.
    p = SamplingParams(stop_token_ids=[7])
    p.update_from_generation_config({"eos_token_id": [2, 128008, 128009]}, 2)
    assert p.eos_token_id == 2
    assert p.stop_token_ids == [7, 128008, 128009]
    assert p.all_stop_token_ids == {2, 7, 128008, 128009}
    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 5}, 2)
    assert q.stop_token_ids == [] and q.all_stop_token_ids == {2, 5}


def test_msgpack_round_trip_keeps_private_fields() -> None:
    p = SamplingParams(temperature=0.5, seed=11, stop=["x"], max_tokens=9)
    p.update_from_generation_config({}, 2)
    q = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert q == p
    assert q.all_stop_token_ids == {2}
