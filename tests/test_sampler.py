"""Sampler: greedy, top-k, top-p, min-p, seeded draws and logprobs."""

from __future__ import annotations

import dataclasses

import torch

from tracevllm.sample.logits_processor import (
    LogitBiasLogitsProcessor,
    LogitsProcessors,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from tracevllm.sample.metadata import SamplingMetadata
from tracevllm.sample.ops.topk_topp_sampler import apply_top_k_top_p, apply_top_k_top_p_pytorch
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
        generators=generators or {},
        max_num_logprobs=max_num_logprobs,
        logitsprocs=LogitsProcessors(
            [MinPLogitsProcessor(torch.tensor(min_p) if min_p is not None else None)]
        ),
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

    batch = InputBatch(4, 32, 64, VOCAB, block_sizes=[4])
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

    batch = InputBatch(4, 32, 64, VOCAB, block_sizes=[4])
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
    assert min_toks(md) == {0: (3, [7], {4, 5})}
    x = logits(1, seed=7)
    x[0, 4] = 100.0  # the greedy pick, were it allowed
    assert sample(x, md) != [4] and sample(x, md)[0] not in (4, 5)
    outputs["b"] += [8, 9]  # three tokens now: stop tokens allowed again
    md = batch.make_sampling_metadata()
    assert min_toks(md) == {}
    assert sample(x, md) == [4]


def min_toks(md: SamplingMetadata) -> dict[int, tuple[int, object, set[int]]]:
    (processor,) = [
        p for p in md.logitsprocs.non_argmax_invariant if isinstance(p, MinTokensLogitsProcessor)
    ]
    return {row: (n, list(out), stop) for row, (n, out, stop) in processor.min_toks.items()}


# ------------------------------------------------- vLLM 0.22.0's callable surface
def vllm_style_metadata(
    batch: int, output_token_ids: list[list[int]], prompt_token_ids: torch.Tensor
) -> SamplingMetadata:
    """Built the way vLLM's own sampler tests build one: every field by name."""
    return SamplingMetadata(
        temperature=torch.full((batch,), 0.0),
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=0,
        no_penalties=True,
        prompt_token_ids=prompt_token_ids,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=output_token_ids,
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def test_apply_penalties_takes_vllms_arguments() -> None:
    """``Sampler().apply_penalties(logits, sampling_metadata, output_token_ids)``:
    the output tokens come as an argument (the bonus token passes its drafts
    in them), not from the metadata."""
    outputs = [[3, 3, 5], [7]]
    md = vllm_style_metadata(2, [[], []], torch.tensor([[1, VOCAB], [2, 4]]))
    md.frequency_penalties = torch.tensor([1.0, 2.0])
    md.no_penalties = False
    x = torch.full((2, VOCAB), 0.5)
    got = Sampler().apply_penalties(x.clone(), md, outputs)
    expected = x.clone()
    expected[0, 3] -= 2.0  # twice, at 1.0 each
    expected[0, 5] -= 1.0
    expected[1, 7] -= 2.0
    torch.testing.assert_close(got, expected)
    # The metadata's own (empty) lists are not what counts.
    assert torch.equal(Sampler().apply_penalties(x.clone(), md, [[], []]), x)


def test_sample_returns_tokens_and_processed_logprobs() -> None:
    """vLLM's ``Sampler.sample`` returns (tokens, processed logprobs); tracevllm
    has only the raw-logprobs mode, so the second is None."""
    x = logits(2, seed=8)
    sampled, processed = Sampler().sample(x.clone(), metadata([0.0, 0.0]))
    assert sampled.tolist() == x.argmax(-1).tolist() and processed is None
    assert Sampler.greedy_sample(x).tolist() == x.argmax(-1).tolist()
    assert Sampler().logprobs_mode == "raw_logprobs"


def test_left_out_metadata_fields_are_refused_not_ignored() -> None:
    import pytest

    md = vllm_style_metadata(1, [[]], torch.tensor([[1]]))
    with pytest.raises(NotImplementedError, match="bad_words_token_ids"):
        dataclasses.replace(md, bad_words_token_ids={0: [[3]]})
    with pytest.raises(NotImplementedError, match="allowed_token_ids_mask"):
        dataclasses.replace(md, allowed_token_ids_mask=torch.zeros(1, VOCAB, dtype=torch.bool))


def test_apply_top_k_top_p_pytorch_and_its_dispatch() -> None:
    """vLLM's names: ``apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync)``,
    and ``apply_top_k_top_p`` dispatching to it; with or without the CPU sync
    (top-k without a sort) the mask is the same."""
    x = logits(4, seed=9)
    k = torch.tensor([1, 5, VOCAB, 3])
    p = torch.tensor([1.0, 0.5, 0.9, 0.2])
    for kk, pp in ((k, None), (None, p), (k, p), (None, None)):
        sync = apply_top_k_top_p_pytorch(x.clone(), kk, pp, allow_cpu_sync=True)
        no_sync = apply_top_k_top_p_pytorch(x.clone(), kk, pp)
        dispatched = apply_top_k_top_p(x.clone(), kk, pp)
        assert torch.equal(sync, no_sync) and torch.equal(sync, dispatched)
    assert torch.isfinite(apply_top_k_top_p_pytorch(x.clone(), k, None)).sum(-1).tolist() == [
        1,
        5,
        VOCAB,
        3,
    ]


# ------------------------------------------------------------------- logit bias
def bias_metadata(
    biases: dict[int, dict[int, float]], temperature: list[float]
) -> SamplingMetadata:
    md = metadata(temperature)
    md.logitsprocs = LogitsProcessors([LogitBiasLogitsProcessor(biases)])
    return md


def test_logit_bias_moves_the_greedy_pick() -> None:
    x = logits(3, seed=10)
    top = x.argmax(-1).tolist()
    md = bias_metadata({0: {7: 100.0}, 2: {top[2]: -100.0}}, [0.0, 0.0, 0.0])
    out = sample(x, md)
    assert out[0] == 7  # +100 forces it
    assert out[1] == top[1]  # no bias, no change
    second = x[2].topk(2).indices[1].item()
    assert out[2] == second  # -100 bans the argmax: the runner-up wins
    # In vLLM's order: before the penalties. A token in the prompt with logit
    # 1.0, bias -3 and repetition penalty 2: (1 - 3) * 2 = -4, not 1 / 2 - 3.
    row = torch.zeros(1, VOCAB)
    row[0, 4] = 1.0
    md = bias_metadata({0: {4: -3.0}}, [0.0])
    md.no_penalties = False
    md.prompt_token_ids = torch.tensor([[4]])
    md.frequency_penalties = md.presence_penalties = torch.zeros(1)
    md.repetition_penalties = torch.tensor([2.0])
    processed = Sampler().apply_logits_processors(row.clone(), md, predict_bonus_token=False)
    assert processed[0, 4].item() == -4.0


def test_logit_bias_random_sampling_never_draws_a_banned_token() -> None:
    x = torch.zeros(1, 4)  # uniform over 4 tokens
    md = bias_metadata({0: {0: -100.0, 1: -100.0}}, [1.0])
    seen = set()
    for seed in range(100):
        md.generators = {0: torch.Generator().manual_seed(seed)}
        seen.add(sample(x, md)[0])
    assert seen == {2, 3}


def test_logit_bias_is_validated_by_name() -> None:
    import pytest

    from tracevllm.sampling_params import SamplingParams

    for bias, error in (
        ({True: 1.0}, TypeError),  # a bool is not a token id
        ({"5": 1.0}, TypeError),  # nor a string (the OpenAI layer converts JSON's)
        ({5: True}, TypeError),
        ({5: float("nan")}, ValueError),
        ({5: float("inf")}, ValueError),
        ({5: 100.5}, ValueError),
        ({5: -101}, ValueError),
        ([5], TypeError),
    ):
        with pytest.raises(error, match="logit_bias"):
            SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
    assert SamplingParams(logit_bias={5: 100, 6: -100.0}).logit_bias == {5: 100, 6: -100.0}


def test_temperature_and_penalties_are_checked_as_float32() -> None:
    """1e308 is a finite float but inf as the sampler's float32: refused by
    name, as is a repetition penalty that rounds to 0 (a division by zero)."""
    import pytest

    from tracevllm.sampling_params import SamplingParams

    for kwargs, name in (
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": 3.5e38}, "temperature"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"repetition_penalty": 1e-50}, "repetition_penalty"),
    ):
        with pytest.raises(ValueError, match=f"^{name} must be .*float32"):
            SamplingParams(**kwargs)
    # The largest float32 itself is fine (the logits all but flatten).
    assert SamplingParams(temperature=3.4e38).temperature == 3.4e38


def test_logit_bias_through_the_engine(tiny_model_dir: str) -> None:
    """Offline, end to end: +100 on a token makes greedy emit only it; -100 on
    the plain greedy's first token makes it another; the same with n-gram
    drafts (the bias applies at every draft position and the bonus); an
    out-of-vocabulary id is refused at the entry, naming it and the vocabulary."""
    import pytest

    from tracevllm import LLM, SamplingParams
    from tracevllm.exceptions import VLLMValidationError

    prompt = "The capital of France is Paris. The capital of Germany is"
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as llm:
        vocab_size = llm.llm_engine.model_config.vocab_size

        def greedy(bias: dict[int, float] | None, engine: LLM = llm) -> list[int]:
            params = SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias=bias
            )
            return list(engine.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)

        plain = greedy(None)
        assert greedy({42: 100.0}) == [42] * 12
        banned = greedy({plain[0]: -100.0})
        assert banned[0] != plain[0] and plain[0] not in banned
        with pytest.raises(VLLMValidationError) as info:
            greedy({5: 1.0, vocab_size: 1.0, -1: 2.0})
        assert str(info.value).startswith(
            f"token_id(s) [{vocab_size}, -1] in logit_bias contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}"
        )
        assert info.value.parameter == "logit_bias"
    with LLM(model=tiny_model_dir, enable_multiprocessing=False, speculative_config=ngram) as llm:
        assert greedy({42: 100.0}, llm) == [42] * 12
        assert greedy({plain[0]: -100.0}, llm) == banned
