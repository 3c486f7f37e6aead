"""The sampler's two-pass greedy pick (sample/ops/argmax.py) against
``torch.argmax``, the reference: the same index on every row, ties, NaN,
infinities, and the shapes that fall back to the plain argmax."""

from __future__ import annotations

import pytest
import torch

from tracevllm.sample.metadata import SamplingMetadata
from tracevllm.sample.ops.argmax import CHUNK, argmax_last_dim
from tracevllm.sample.sampler import Sampler


def check(x: torch.Tensor) -> None:
    got = argmax_last_dim(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))


@pytest.mark.parametrize("rows", [0, 1, 3, 64])
@pytest.mark.parametrize("vocab", [2 * CHUNK, 49152, 32000])
def test_random_rows(rows: int, vocab: int) -> None:
    check(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab)))


def test_ties_take_the_first_index() -> None:
    """The max at several places: across chunks, inside one chunk, at a
    chunk's edges. Mutation caught: `last` occurrence (flip before argmax)
    and the chunk index taken from the second-largest chunk."""
    x = torch.zeros(6, 4 * CHUNK)
    x[0, [5, CHUNK + 5, 3 * CHUNK]] = 7.0  # across chunks
    x[1, [CHUNK + 1, CHUNK + 2]] = 7.0  # inside one chunk
    x[2, [CHUNK - 1, CHUNK]] = 7.0  # either side of an edge
    x[3, -1] = 7.0  # the very last
    x[4] = -5.0  # every value equal
    x[5, 2 * CHUNK + 3], x[5, 17] = 7.0, 6.5  # the first chunk's max is not the row's
    check(x)
    assert argmax_last_dim(x).tolist() == [5, CHUNK + 1, CHUNK - 1, 4 * CHUNK - 1, 0, 2 * CHUNK + 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_other_dtypes(dtype: torch.dtype) -> None:
    """Low precision makes ties common: still the first index."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(16, 4 * CHUNK, generator=gen) * 4).to(dtype)
    x[3, [CHUNK + 2, 3 * CHUNK]] = x.max() + 1  # a tie across chunks
    check(x)


def test_nan_and_infinities_as_torch() -> None:
    x = torch.randn(5, 3 * CHUNK, generator=torch.Generator().manual_seed(0))
    x[0, [2 * CHUNK + 7, CHUNK + 9]] = float("nan")  # two NaNs: the first
    x[1, CHUNK] = float("nan")
    x[1, 3] = float("inf")  # a NaN beats +inf
    x[2] = float("-inf")  # a row of -inf
    x[3, [4, 2 * CHUNK]] = float("inf")  # two +inf
    x[4, 0] = -0.0
    x[4, 1:] = -1.0
    x[4, CHUNK] = 0.0  # -0.0 and 0.0 tie: the first
    check(x)


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(4, 50257),  # not whole chunks
        torch.randn(8, 2 * CHUNK)[::2],  # rows not contiguous
        torch.randn(2, 3, 2 * CHUNK),  # not 2-D
        torch.randn(2 * CHUNK, 4).t(),  # transposed
    ],
)
def test_other_shapes_fall_back(x: torch.Tensor) -> None:
    assert torch.equal(argmax_last_dim(x), x.argmax(dim=-1))


def test_the_samplers_pick_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows, the random draw's race and the rejection sampler's
    target argmax go through the two passes, with argmax's indices.
    Mutations caught: greedy_sample, random_sample or rejection_sample back
    to `.argmax` (no call)."""
    from tracevllm.sample import rejection_sampler, sampler
    from tracevllm.sample.ops import topk_topp_sampler

    calls: list[tuple[int, ...]] = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return argmax_last_dim(x)

    for module in (sampler, topk_topp_sampler, rejection_sampler):
        monkeypatch.setattr(module, "argmax_last_dim", spy)
    x = torch.randn(64, 49152, generator=torch.Generator().manual_seed(3))
    x[7, [100, 40000]] = 99.0
    got = Sampler.greedy_sample(x)
    assert got.shape == (64,) and torch.equal(got, x.argmax(dim=-1)) and got[7] == 100
    assert calls == [(64, 49152)]
    probs = x.softmax(dim=-1)
    torch.manual_seed(0)
    want = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    torch.manual_seed(0)
    assert torch.equal(topk_topp_sampler.random_sample(probs.clone(), {}), want)
    assert calls[-1] == (64, 49152)
    # The rejection sampler, all greedy: two drafts, the second rejected.
    md = SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None,
    )  # fmt: skip
    first = int(x[0].argmax())
    out = rejection_sampler.rejection_sample(
        torch.tensor([first, 5], dtype=torch.int32), [2], 2,
        torch.tensor([2], dtype=torch.int32), None, x[:2].clone(), torch.tensor([[9]]), md,
    )  # fmt: skip
    assert out.tolist() == [[first, int(x[1].argmax()), -1]]
    assert calls[-1] == (2, 49152)


def test_bench_greedy_times_both_picks(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark script's pick alone: both timed, one line per size."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_greedy

    out = tmp_path / "greedy.json"
    bench_greedy.main(
        ["--threads", "1", "--rows", "1,16", "--skip-engine", "--output-json", str(out)]
    )
    res = json.loads(out.read_text())
    assert [p["rows"] for p in res["pick"]] == [1, 16]
    assert all(p["ms"]["argmax"] > 0 and p["ms"]["two_pass"] > 0 for p in res["pick"])
    assert capsys.readouterr().out.count("pick alone, 1 thread(s)") == 2
