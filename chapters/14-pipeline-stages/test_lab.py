"""Lab 14 tests: get_pp_indices by hand, against the definition, and with a
partition set by hand (TRACEVLLM_PP_LAYER_PARTITION)."""

from __future__ import annotations

import pytest
from _labkit import load

get_pp_indices = load(__file__, "get_pp_indices")
PARTITION = "TRACEVLLM_PP_LAYER_PARTITION"


@pytest.fixture(autouse=True)
def no_partition_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """An even split unless a test sets one (whatever the shell has)."""
    monkeypatch.delenv(PARTITION, raising=False)


def stages(num_hidden_layers: int, pp_size: int) -> list[tuple[int, int]]:
    return [get_pp_indices(num_hidden_layers, r, pp_size) for r in range(pp_size)]


def slow_partition(num_hidden_layers: int, pp_size: int) -> list[int]:
    """The definition, one layer at a time: deal the layers out evenly, then
    hand each left-over layer to the next stage back from the second-to-last."""
    counts = [num_hidden_layers // pp_size] * pp_size
    left_over = num_hidden_layers - sum(counts)
    stage = pp_size - 2
    while left_over:
        counts[stage] += 1
        left_over -= 1
        stage -= 1
    return counts


def test_the_default_model_over_four_stages_by_hand() -> None:
    # 30 layers, 4 stages: 7 each and 2 left over, for stages 2 and 1.
    assert stages(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]


def test_an_even_split_and_a_single_stage() -> None:
    assert stages(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert stages(30, 1) == [(0, 30)]
    assert stages(4, 2) == [(0, 2), (2, 4)]


def test_the_remainder_never_goes_to_the_last_stage() -> None:
    # The last stage also runs the final norm and the LM head.
    assert stages(5, 2) == [(0, 3), (3, 5)]
    assert stages(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert stages(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]


def test_more_stages_than_layers() -> None:
    # 2 layers over 4 stages: the two stages before the last get one each.
    assert stages(2, 4) == [(0, 0), (0, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("pp_size", [1, 2, 3, 4, 5, 8])
def test_every_layer_on_exactly_one_stage(pp_size: int) -> None:
    for num_hidden_layers in range(pp_size, 41):
        got = stages(num_hidden_layers, pp_size)
        assert got[0][0] == 0 and got[-1][1] == num_hidden_layers
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))  # contiguous, in order
        counts = [end - start for start, end in got]
        assert counts == slow_partition(num_hidden_layers, pp_size), (num_hidden_layers, counts)


def test_a_partition_set_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PARTITION, "8,8,8,6")
    assert stages(30, 4) == [(0, 8), (8, 16), (16, 24), (24, 30)]
    monkeypatch.setenv(PARTITION, "2,28")  # uneven on purpose: a bigger last stage
    assert stages(30, 2) == [(0, 2), (2, 30)]


@pytest.mark.parametrize(
    ("partition", "pp_size", "message"),
    [
        ("8,8,x,6", 4, "Invalid partition string: 8,8,x,6"),
        ("10,10,10", 4, "len(partitions)=3 does not match pp_size=4."),
        ("8,8,8,8", 4, "sum(partitions)=32 does not match num_hidden_layers=30."),
    ],
)
def test_a_bad_partition_is_refused(
    monkeypatch: pytest.MonkeyPatch, partition: str, pp_size: int, message: str
) -> None:
    monkeypatch.setenv(PARTITION, partition)
    with pytest.raises(ValueError) as err:
        get_pp_indices(30, 0, pp_size)
    assert str(err.value) == message
