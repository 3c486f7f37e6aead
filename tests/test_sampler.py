"""Sampler: greedy, top-k, top-p, min-p, seeded draws and logprobs."""

from __future__ import annotations

import torch

from tracevllm.sample.metadata import SamplingMetadata
from tracevllm.sample.ops.topk_topp_sampler import apply_top_k_top_p
from tracevllm.sample.sampler import Sampler

VOCAB = 50


def metadata(
    temperature: list[float],
    top_p: list[float] | None = None,
    top_k: list[int] | None = None,
    min_p: list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    max_num_logprobs: int | None = None,
) -> SamplingMetadata:
    temp = torch.tensor(temperature)
    return SamplingMetadata(
        temperature=None if all(t == 0 for t in temperature) else temp,
        all_greedy=all(t == 0 for t in temperature),
        all_random=all(t > 0 for t in temperature),
        top_p=torch.tensor(top_p) if top_p is not None else None,
        top_k=torch.tensor(top_k, dtype=torch.int32) if top_k is not None else None,
        min_p=torch.tensor(min_p) if min_p is not None else None,
        generators=generators or {},
        max_num_logprobs=max_num_logprobs,
    )


def logits(num_reqs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_reqs, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sample(x: torch.Tensor, md: SamplingMetadata) -> list[int]:
    return Sampler()(x.clone(), md).sampled_token_ids.squeeze(1).tolist()


def test_greedy_is_argmax() -> None:
    x = logits(4)
    assert sample(x, metadata([0.0] * 4)) == x.argmax(-1).tolist()


def test_top_k_1_is_greedy_even_at_high_temperature() -> None:
    x = logits(4, seed=1)
    for seed in range(5):
        torch.manual_seed(seed)
        assert sample(x, metadata([2.0] * 4, top_k=[1] * 4)) == x.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows() -> None:
    x = logits(3, seed=2)
    torch.manual_seed(0)
    out = sample(x, metadata([0.0, 1.0, 0.0], top_k=[VOCAB, 1, VOCAB]))
    assert out == x.argmax(-1).tolist()


def test_top_p_masks_the_tail() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0.5, 0.3} (tail mass 0.2 <= 0.25).
    x = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = apply_top_k_top_p(x.clone(), None, torch.tensor([0.75]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    # A tiny top_p still keeps the most likely token.
    out = apply_top_k_top_p(x.clone(), None, torch.tensor([0.01]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]
    # top_k and top_p together: k=3 then p=0.95 of the renormalized rest.
    out = apply_top_k_top_p(x.clone(), torch.tensor([3]), torch.tensor([0.95]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]


def test_top_k_keeps_k_per_row() -> None:
    x = logits(3, seed=3)
    out = apply_top_k_top_p(x.clone(), torch.tensor([1, 5, VOCAB]), None)
    assert torch.isfinite(out).sum(-1).tolist() == [1, 5, VOCAB]
    kept = torch.isfinite(out[1])
    assert set(kept.nonzero().squeeze(1).tolist()) == set(x[1].topk(5).indices.tolist())


def test_min_p_drops_unlikely_tokens() -> None:
    # probs 0.6, 0.3, 0.1: min_p 0.4 cuts below 0.24, leaving tokens 0 and 1.
    x = torch.tensor([[0.6, 0.3, 0.1]]).log()
    md = metadata([1.0], min_p=[0.4])
    seen = set()
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        md.generators = {0: g}
        seen.add(sample(x, md)[0])
    assert seen == {0, 1}


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    x = logits(4, seed=4)
    alone = sample(x[2:3], metadata([1.0], generators={0: torch.Generator().manual_seed(7)}))
    torch.manual_seed(123)
    crowd = sample(
        x,
        metadata(
            [1.0, 0.0, 1.0, 0.7],
            generators={2: torch.Generator().manual_seed(7)},
        ),
    )
    assert crowd[2] == alone[0]
    # A sequence of draws from one generator is reproducible too.
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    seq1 = [sample(x[:1], metadata([1.0], generators={0: g1}))[0] for _ in range(10)]
    seq2 = [sample(x[:1], metadata([1.0], generators={0: g2}))[0] for _ in range(10)]
    assert seq1 == seq2 and len(set(seq1)) > 1


def test_random_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    x = probs.log().expand(4000, 3).contiguous()
    torch.manual_seed(0)
    out = torch.tensor(sample(x, metadata([1.0] * 4000)))
    freq = torch.bincount(out, minlength=3).float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_logprobs_and_ranks() -> None:
    x = logits(3, seed=5)
    md = metadata([0.0, 0.0, 0.0], max_num_logprobs=2)
    out = Sampler()(x.clone(), md)
    lp = out.logprobs_tensors
    assert lp is not None
    raw = x.log_softmax(-1)
    sampled = x.argmax(-1)
    assert lp.logprob_token_ids.shape == (3, 3) and lp.logprobs.shape == (3, 3)
    assert lp.logprob_token_ids[:, 0].tolist() == sampled.tolist()
    assert lp.logprob_token_ids[:, 1:].tolist() == raw.topk(2).indices.tolist()
    torch.testing.assert_close(lp.logprobs[:, 1:], raw.topk(2).values)
    assert lp.selected_token_ranks.tolist() == [1, 1, 1]
    # Logprobs are the raw model's, not after temperature; ranks of a random pick.
    md = metadata([5.0, 5.0, 5.0], max_num_logprobs=0)
    torch.manual_seed(1)
    out = Sampler()(x.clone(), md)
    lp = out.logprobs_tensors
    assert lp is not None
    ids = out.sampled_token_ids.squeeze(1).long()
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, ids[:, None]).squeeze(1))
    expected_ranks = (raw > raw.gather(1, ids[:, None])).sum(-1) + 1
    assert lp.selected_token_ranks.tolist() == expected_ranks.tolist()
    lists = lp.tolists()
    assert lists.sampled_token_ranks == expected_ranks.tolist()


def test_penalties_follow_their_definitions() -> None:
    """apply_all_penalties against the definitions, token by token: repetition over
    prompt and output (divide positive logits, multiply negative ones), then
    frequency x count and presence x seen over the output only; padding counts for nothing."""
    from tracevllm.sample.ops.penalties import apply_all_penalties

    vocab = 8
    x = logits(3, seed=5)[:, :vocab]  # positive and negative logits
    prompts = [[1, 2, 2], [3], [6, 6]]
    outputs = [[2, 5, 5], [], [7]]
    rep, freq, pres = [1.5, 1.0, 2.0], [0.5, 0.0, -0.5], [0.25, 1.0, 0.0]
    expected = x.clone()
    for r in range(3):
        for t in range(vocab):
            v = float(expected[r, t])
            if t in prompts[r] or t in outputs[r]:
                v = v / rep[r] if v > 0 else v * rep[r]
            count = outputs[r].count(t)
            expected[r, t] = v - freq[r] * count - pres[r] * (count > 0)
    longest = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([p + [vocab] * (longest - len(p)) for p in prompts])
    got = apply_all_penalties(
        x.clone(),
        prompt_ids,
        torch.tensor(pres),
        torch.tensor(freq),
        torch.tensor(rep),
        outputs,
    )
    torch.testing.assert_close(got, expected)


def test_input_batch_keeps_penalties_with_their_rows() -> None:
    """Through remove + condense (a row moves), each request keeps its penalties and prompt."""
    from tracevllm.sampling_params import SamplingParams
    from tracevllm.worker.input_batch import CachedRequestState, InputBatch

    batch = InputBatch(4, 32, 64, VOCAB, block_size=4)
    prompts = {"a": [1, 2, 3], "b": [4], "c": [5, 6]}
    knobs = {"a": (1.2, 0.0, 0.0), "b": (1.0, 0.0, 0.0), "c": (1.0, 0.5, -1.0)}
    for req_id, prompt in prompts.items():
        rep, freq, pres = knobs[req_id]
        params = SamplingParams(
            temperature=0.0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres
        )
        state = CachedRequestState(req_id, prompt, params, None, ([0],), 0, output_token_ids=[9])
        batch.add_request(state)
    assert batch.make_sampling_metadata().no_penalties is False
    batch.remove_request("a")
    batch.condense()  # "c" moves from row 2 to row 0
    md = batch.make_sampling_metadata()
    assert batch.req_ids == ["c", "b"]
    assert md.prompt_token_ids is not None and md.repetition_penalties is not None
    assert md.prompt_token_ids.tolist() == [[5, 6], [4, VOCAB]]
    assert md.repetition_penalties.tolist() == [1.0, 1.0]
    assert md.frequency_penalties is not None and md.frequency_penalties.tolist() == [0.5, 0.0]
    assert md.presence_penalties is not None and md.presence_penalties.tolist() == [-1.0, 0.0]
    assert md.output_token_ids == [[9], [9]]
    batch.remove_request("c")
    batch.condense()
    assert batch.make_sampling_metadata().no_penalties  # "b" uses none


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    """The batch lists rows still short of min_tokens (through a row move); the
    sampler sets their stop tokens to -inf, so even greedy cannot pick them."""
    from tracevllm.sampling_params import SamplingParams
    from tracevllm.worker.input_batch import CachedRequestState, InputBatch

    batch = InputBatch(4, 32, 64, VOCAB, block_size=4)
    outputs: dict[str, list[int]] = {"a": [], "b": [7]}
    for req_id, min_tokens in (("a", 0), ("b", 3)):
        params = SamplingParams(temperature=0.0, min_tokens=min_tokens, stop_token_ids=[4, 5])
        state = CachedRequestState(
            req_id, [1, 2], params, None, ([0],), 0, output_token_ids=outputs[req_id]
        )
        batch.add_request(state)
    batch.remove_request("a")
    batch.condense()  # "b" moves to row 0
    md = batch.make_sampling_metadata()
    assert md.min_tokens == {0: (3, {4, 5})}
    x = logits(1, seed=7)
    x[0, 4] = 100.0  # the greedy pick, were it allowed
    assert sample(x, md) != [4] and sample(x, md)[0] not in (4, 5)
    outputs["b"] += [8, 9]  # three tokens now: stop tokens allowed again
    md = batch.make_sampling_metadata()
    assert md.min_tokens == {}
    assert sample(x, md) == [4]
