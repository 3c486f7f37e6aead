"""Speculative decoding through the whole engine, on tiny random-weight models.

Greedy output with drafts equals greedy output without, token for token,
with chunked prefill, prefix-cache hits and preemption in the same run, and
the KV accounting checked after every step; stops land in the middle of an
accepted run; random sampling keeps the target's distribution (a
chi-square test); penalties, min-tokens, logprobs and seeds behave as
without drafts; bad draft models are refused at the entry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.test_scheduler import check_blocks
from tests.test_spec_decode import ALPHA
from tests.utils import make_tiny_llama
from tracevllm import LLM, SamplingParams

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
# Prompts whose greedy continuations soon repeat themselves (random weights loop).
# A shared first block (16 tokens) and then some: prefix-cache hits happen.
PREFIX = "Continue the text below, in the same style, for as long as you can: "
PROMPTS = [
    PREFIX + "1 2 3 4 5 1 2 3 4 5 1 2 3",
    PREFIX + "The capital of France is Paris. The capital of Germany is",
    PREFIX + "A paged KV cache stores keys and values in fixed-size blocks.",
    PREFIX + "Hello, world! Hello, world! Hello,",
    PREFIX + "The scheduler decides which requests run in each step of the engine.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """The target here: a tiny Llama with tied embeddings, whose greedy output
    mostly repeats its last token, now and then switching to another (so
    n-gram drafts are often kept, sometimes rejected). The default model's
    vocabulary, so conftest's tiny model can be its (useless) draft model."""
    path = tmp_path_factory.mktemp("tiny-tied")
    return make_tiny_llama(str(path), seed=0, tokenizer_from=default_model_dir,
                           tie_word_embeddings=True)  # fmt: skip


def _llm(model: str, **kwargs: Any) -> LLM:
    return LLM(model=model, enable_multiprocessing=False, **kwargs)


@pytest.fixture(scope="module")
def baseline(tied_dir: str) -> list[list[int]]:
    with _llm(tied_dir) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _engine_core(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core


def check_kv_accounting(core: Any) -> None:
    """After a step: every block is free or held, each held block's ref_cnt is
    its number of holders (check_blocks), and each running request holds the
    blocks of the tokens it has computed (rolled back past rejected drafts)."""
    sched = core.scheduler
    check_blocks(sched)
    mgr = sched.kv_cache_manager
    for req in sched.running:
        assert req.num_computed_tokens <= req.num_tokens
        num_blocks = len(mgr.get_block_ids(req.request_id)[0])
        assert num_blocks * sched.block_size >= req.num_computed_tokens


class StepChecker:
    """Run a check after every update_from_output, and record the spec stats."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.drafted = self.accepted = self.steps = 0
        self.max_emitted = 0
        sched = core.scheduler
        original = sched.update_from_output

        def checked(so: Any, out: Any) -> Any:
            result = original(so, out)
            check_kv_accounting(core)
            self.steps += 1
            stats = sched.spec_decoding_stats
            if stats is not None:
                self.drafted += stats.num_draft_tokens
                self.accepted += stats.num_accepted_tokens
            self.max_emitted = max([self.max_emitted, *map(len, out.sampled_token_ids)])
            return result

        sched.update_from_output = checked

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)


@pytest.fixture
def spec_llm(request: pytest.FixtureRequest, tied_dir: str) -> Iterator[tuple[LLM, Any]]:
    with _llm(tied_dir, **request.param) as llm:
        yield llm, StepChecker(_engine_core(llm))


def _draft(model_dir: str, **kw: Any) -> dict[str, Any]:
    return {"method": "draft_model", "model": model_dir, "num_speculative_tokens": K, **kw}


@pytest.mark.parametrize("k", [2, 4])
def test_ngram_greedy_is_lossless(tied_dir: str, baseline: Any, k: int) -> None:
    with _llm(tied_dir, speculative_config={**NGRAM, "num_speculative_tokens": k}) as llm:
        checker = StepChecker(_engine_core(llm))
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == baseline
    assert checker.accepted > 0 and checker.max_emitted == k + 1  # runs of k + 1 happened
    assert checker.steps < 40  # fewer steps than tokens


def test_self_draft_accepts_every_greedy_draft(tied_dir: str, baseline: Any) -> None:
    with _llm(tied_dir, speculative_config=_draft(tied_dir)) as llm:
        checker = StepChecker(_engine_core(llm))
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == baseline
    assert checker.drafted > 0 and checker.acceptance_rate == 1.0


def test_random_draft_model_is_rejected_and_stays_lossless(
    tied_dir: str, tiny_model_dir: str, baseline: Any
) -> None:
    with _llm(tied_dir, speculative_config=_draft(tiny_model_dir)) as llm:
        checker = StepChecker(_engine_core(llm))
        outputs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == baseline[:3]
    assert checker.drafted > 0 and checker.acceptance_rate < 0.2


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_lossless_with_chunks_prefix_hits_and_preemption(
    tied_dir: str, baseline: Any, method: str
) -> None:
    """16 tokens a step (chunked prefill) and room for about two requests
    (preemption); then the prompts again (prefix hits on what is left)."""
    spec = NGRAM if method == "ngram" else _draft(tied_dir)
    with _llm(
        tied_dir,
        speculative_config=spec,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=12,
        max_model_len=12 * 16,  # what 12 blocks hold: a smaller pool refuses to start
    ) as llm:
        checker = StepChecker(_engine_core(llm))
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.llm_engine.num_preemptions > 0
        again = llm.generate(PROMPTS[::-1], GREEDY, use_tqdm=False)[::-1]
    assert [o.outputs[0].token_ids for o in outputs + again] == baseline + baseline
    assert any(o.num_cached_tokens > 0 for o in again)
    assert checker.accepted > 0


@pytest.mark.parametrize("spec_llm", [{"speculative_config": NGRAM}], indirect=True)
def test_stops_in_the_middle_of_a_run_match_plain_decoding(
    spec_llm: tuple[LLM, Any], baseline: Any
) -> None:
    """Every cut point of one greedy output, by max_tokens, stop token and
    stop string: with runs of up to k + 1 tokens, most land mid-run."""
    llm, checker = spec_llm
    tokenizer = llm.get_tokenizer()
    tokens = baseline[0][:16]
    params = []
    for i, token in enumerate(tokens):
        first = tokens.index(token)  # the token's first occurrence is where it stops
        params += [
            SamplingParams(temperature=0.0, max_tokens=i + 1, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[token]),
        ]
        assert first <= i
    stop_text = tokenizer.decode(tokens[4:6])
    params.append(SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_text]))
    outputs = llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)
    for i, token in enumerate(tokens):
        by_length, by_token = outputs[2 * i], outputs[2 * i + 1]
        assert by_length.outputs[0].token_ids == tokens[: i + 1]
        first = tokens.index(token)
        assert by_token.outputs[0].token_ids == tokens[: first + 1]
        assert by_token.outputs[0].finish_reason == "stop"
    text = tokenizer.decode(baseline[0])
    assert outputs[-1].outputs[0].text == text[: text.index(stop_text)]
    assert checker.max_emitted > 1


def _stop_params(tokenizer: Any, tokens: list[int]) -> list[SamplingParams]:
    """Stop strings that end at each of the first cut points of a greedy
    output (the text of its tokens 2 to 2 + j: the output soon repeats one
    token, which n-gram drafts keep), and one kept in the output. With runs
    of up to k + 1 tokens a step, most stops land mid-run."""
    stops = [tokenizer.decode(tokens[2 : 2 + j]) for j in range(1, 13)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[s], logprobs=1) for s in stops]
    params.append(SamplingParams(temperature=0.0, max_tokens=40, stop=[stops[6]],
                                 include_stop_str_in_output=True))  # fmt: skip
    return params


def test_a_stop_string_mid_run_cuts_ids_and_usage_as_plain_decoding(
    tied_dir: str, baseline: Any
) -> None:
    """The tokens accepted after the one that completes a stop string are not
    output: token ids, logprobs and the token counts are those of decoding
    one token a step, not only the text."""
    results, tokenizer = [], None
    for spec in (None, NGRAM):
        with _llm(tied_dir, speculative_config=spec) as llm:
            tokenizer = llm.get_tokenizer()
            checker = StepChecker(_engine_core(llm))
            params = _stop_params(tokenizer, baseline[0])
            results.append(llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False))
    assert checker.accepted > 0 and checker.max_emitted > 1
    plain, spec_out = results
    for a, b in zip(plain, spec_out):
        x, y = a.outputs[0], b.outputs[0]
        assert x.finish_reason == "stop" and isinstance(x.stop_reason, str)
        assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (
            x.token_ids, x.text, x.finish_reason, x.stop_reason
        )  # fmt: skip
        assert len(y.token_ids) <= 14  # cut mid-output, not at max_tokens
        if x.logprobs is not None:
            assert y.logprobs is not None and len(y.logprobs) == len(y.token_ids)
        assert a.metrics is not None and b.metrics is not None
        assert (
            b.metrics.num_generation_tokens == a.metrics.num_generation_tokens == len(x.token_ids)
        )


def test_a_stop_string_mid_run_through_async_llm_streamed(tied_dir: str, baseline: Any) -> None:
    """The same through AsyncLLM (the server's engine), streamed as deltas:
    the deltas add up to plain decoding's token ids, and usage is their count."""
    import asyncio

    from tracevllm.engine.arg_utils import EngineArgs
    from tracevllm.engine.async_llm import AsyncLLM
    from tracevllm.sampling_params import RequestOutputKind

    with _llm(tied_dir) as llm:
        params = _stop_params(llm.get_tokenizer(), baseline[0])
        plain = llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)

    async def run() -> list[tuple[list[int], str]]:
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model=tied_dir, speculative_config=NGRAM, enable_prefix_caching=False)
        )
        try:

            async def one(i: int, p: SamplingParams) -> tuple[list[int], str]:
                p = p.clone()
                p.output_kind = RequestOutputKind.DELTA
                ids: list[int] = []
                text = ""
                async for out in engine.generate(PROMPTS[0], p, f"r{i}"):
                    ids += out.outputs[0].token_ids
                    text += out.outputs[0].text
                return ids, text

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(params))))
        finally:
            engine.shutdown()

    streamed = asyncio.run(run())
    assert streamed == [(o.outputs[0].token_ids, o.outputs[0].text) for o in plain]


def test_penalties_min_tokens_and_logprobs_match_plain_decoding(tied_dir: str) -> None:
    """Each draft position sees its own past (earlier drafts count for the
    penalties and min-tokens); logprobs are those of the emitted tokens."""
    eos = None
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.5,
                       frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20),
    ]  # fmt: skip
    results = []
    for spec in (None, NGRAM):
        with _llm(tied_dir, speculative_config=spec) as llm:
            eos = llm.get_tokenizer().eos_token_id
            checker = StepChecker(_engine_core(llm))
            results.append(llm.generate([PROMPTS[3]] * 3, params, use_tqdm=False))
    plain, spec_out = results
    assert checker.accepted > 0
    for a, b in zip(plain, spec_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lp_a, lp_b = plain[1].outputs[0].logprobs, spec_out[1].outputs[0].logprobs
    assert lp_a is not None and lp_b is not None and len(lp_a) == len(lp_b) == 30
    for pos_a, pos_b in zip(lp_a, lp_b):
        assert pos_a.keys() == pos_b.keys()
        for t in pos_a:
            assert pos_a[t].logprob == pytest.approx(pos_b[t].logprob, abs=1e-4)
            assert pos_a[t].rank == pos_b[t].rank
    assert eos not in spec_out[2].outputs[0].token_ids[:20]


def test_seeded_sampling_is_reproducible_and_n_works(tied_dir: str) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, seed=7, n=2)
    with _llm(tied_dir, speculative_config=NGRAM) as llm:
        first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        # Again, beside other requests: a seeded request's draws are its own.
        again = llm.generate(PROMPTS[:2] + PROMPTS[2:], params, use_tqdm=False)
    for a, b in zip(first, again):
        assert len(a.outputs) == 2
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


# ---------------------------------------------------- the target distribution
@pytest.fixture(scope="module")
def small_vocab_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny models on a 413-token vocabulary: a target and a (poor) draft."""
    target = make_tiny_llama(str(tmp_path_factory.mktemp("small-target")), seed=3)
    draft = make_tiny_llama(str(tmp_path_factory.mktemp("small-draft")), seed=4)
    return target, draft


def _token_counts(outputs: Any, position: int) -> dict[int, int]:
    counts: dict[int, int] = {}
    for o in outputs:
        token = o.outputs[0].token_ids[position]
        counts[token] = counts.get(token, 0) + 1
    return counts


def two_sample_p_value(a: dict[int, int], b: dict[int, int]) -> float:
    """Chi-square test that two samples of tokens come from one distribution
    (a 2 x tokens contingency table); tokens with fewer than 10 draws in both
    together are pooled into one column."""
    tokens = sorted(set(a) | set(b))
    big = [t for t in tokens if a.get(t, 0) + b.get(t, 0) >= 10]
    rest = [t for t in tokens if t not in big]
    table = np.array(
        [[c.get(t, 0) for t in big] + [sum(c.get(t, 0) for t in rest)] for c in (a, b)],
        dtype=float,
    )
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1  # (2 - 1) * (columns - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


N_DRAWS = 300


@pytest.mark.parametrize(
    "which, temperature",
    [("greedy-drafts", 0.1), ("sampled-drafts", 0.5)],
    ids=["no-q-as-ngram", "with-q"],
)
def test_random_sampling_keeps_the_target_distribution(
    small_vocab_dirs: tuple[str, str], which: str, temperature: float
) -> None:
    """N seeded requests, with and without drafts: the tokens at positions
    1, 2 and 3 (past the prefill, so through the rejection sampler) follow
    the same distribution, chi-square at ALPHA.

    Two kinds of drafts: the target drafting for itself greedily (no q: the
    rejection sampler treats them as n-gram drafts, which random weights
    would rarely propose), and a poor draft model sampling its drafts (q
    goes along). The temperatures give the target's p enough peak to keep
    some drafts and reject others. The seeds are fixed, so the test is
    deterministic; a wrong acceptance rule or recovered-token draw shifts
    these distributions far past ALPHA.
    """
    target, draft = small_vocab_dirs
    if which == "greedy-drafts":
        spec = _draft(target)
    else:
        spec = _draft(draft, draft_sample_method="probabilistic")
    runs = []
    for config, seed in ((None, 100_000), (spec, 0)):
        params = [
            SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, seed=seed + i)
            for i in range(N_DRAWS)
        ]
        with _llm(target, speculative_config=config, max_num_seqs=256) as llm:
            checker = StepChecker(_engine_core(llm))
            prompt = "The capital of France is Paris. The capital of"
            runs.append(llm.generate([prompt] * N_DRAWS, params, use_tqdm=False))
    plain, spec_out = runs
    assert checker.drafted >= 2 * N_DRAWS  # every request's decodes had drafts
    assert 0.05 < checker.acceptance_rate < 0.95, checker.acceptance_rate  # kept and rejected
    for position in (1, 2, 3):
        p = two_sample_p_value(_token_counts(plain, position), _token_counts(spec_out, position))
        assert p > ALPHA, (position, p)


def test_a_draft_model_with_another_vocabulary_is_refused(tied_dir: str, tmp_path: Any):
    other = make_tiny_llama(str(tmp_path / "other-vocab"), seed=0)  # 512 tokens, not 49152
    with pytest.raises(ValueError, match="same vocabulary size"):
        _llm(tied_dir, speculative_config=_draft(other))
    with pytest.raises(ValueError, match="does not exist"):
        _llm(tied_dir, speculative_config=_draft(str(tmp_path / "nowhere")))


# ------------------------------------------------------- spans, views, metrics
def test_spans_views_and_metrics_show_the_drafts(tied_dir: str) -> None:
    """The proposer and the rejection sampler have spans; the step view says
    which drafts were kept; llm_request and the Prometheus counters carry the
    acceptance counts, and they agree with the scheduler's."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from rich.console import Console

    from tracevllm.metrics.loggers import PrometheusStatLogger
    from tracevllm.metrics.stats import IterationStats
    from tracevllm.tracing.attributes import SpanAttributes
    from tracevllm.tracing.exporters import SpanRecord
    from tracevllm.views.report import RichViewProcessor, render_report

    exporter = InMemorySpanExporter()
    live = Console(record=True, width=100)
    metrics = PrometheusStatLogger("tiny", num_speculative_tokens=K)
    with _llm(tied_dir, speculative_config=NGRAM, trace_detail="request") as llm:
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        provider.add_span_processor(RichViewProcessor(live))
        checker = StepChecker(_engine_core(llm))
        sched = _engine_core(llm).scheduler
        original = sched.make_stats

        def make_stats() -> Any:  # feed the logger what the frontend would
            stats = original()
            metrics.record(stats, IterationStats())
            return stats

        sched.make_stats = make_stats
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    spans = list(exporter.get_finished_spans())
    names = {s.name for s in spans}
    assert {"RejectionSampler.forward", "ModelRunner.propose_draft_token_ids"} <= names
    rejection = [s for s in spans if s.name == "RejectionSampler.forward"]
    assert (
        sum(sum(s.attributes["tracevllm.spec_decode.num_accepted_tokens"]) for s in rejection)
        == checker.accepted
    )
    requests = [s.attributes for s in spans if s.name == "llm_request"]
    assert (
        sum(a[SpanAttributes.SPEC_DECODE_NUM_ACCEPTED_TOKENS] for a in requests) == checker.accepted
    )
    assert sum(a[SpanAttributes.SPEC_DECODE_NUM_DRAFT_TOKENS] for a in requests) == checker.drafted

    # The live view and the one drawn from saved spans both show the drafts.
    saved = Console(record=True, width=100)
    records = [
        SpanRecord(
            trace_id=f"{s.context.trace_id:032x}",
            span_id=f"{s.context.span_id:016x}",
            parent_span_id=f"{s.parent.span_id:016x}" if s.parent else None,
            name=s.name,
            start_ns=s.start_time or 0,
            end_ns=s.end_time or 0,
            attributes=dict(s.attributes or {}),
            resource=dict(s.resource.attributes),
        )
        for s in spans
    ]
    render_report(records, saved)
    for console in (live, saved):
        text = console.export_text()
        assert "drafts (speculative decoding)" in text and "✓" in text and "✗" in text
        assert "→" in text and "kept" in text and "drafts kept" in text

    page = metrics.render().decode()
    labels = '{engine="0",model_name="tiny"}'
    assert f"vllm:spec_decode_num_accepted_tokens_total{labels} {float(checker.accepted)}" in page
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"}'
        in page
    )


def test_a_request_whose_drafts_cannot_fit_the_cache_is_refused(tied_dir: str) -> None:
    """Two usable blocks (32 slots): 20 prompt tokens + 12 fit alone. With
    n-gram drafts too: where the drafts do not fit, the request preempts
    itself and comes back without them (as in vLLM). A draft model also
    reserves k lookahead slots when a request is admitted, so the request
    would wait forever: it is refused at the entry."""
    prompt = {"prompt_token_ids": list(range(100, 120))}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    small = {"num_gpu_blocks_override": 3, "max_model_len": 3 * 16}  # what 3 blocks hold
    with _llm(tied_dir, **small) as llm:
        plain = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(plain) == 12
    with _llm(tied_dir, **small, speculative_config=NGRAM) as llm:
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == plain
    with _llm(tied_dir, **small, speculative_config=_draft(tied_dir)) as llm:
        with pytest.raises(ValueError, match="needs up to 3 KV cache blocks"):
            llm.generate(prompt, params, use_tqdm=False)
        short = SamplingParams(temperature=0.0, max_tokens=12 - K, ignore_eos=True)
        assert llm.generate(prompt, short, use_tqdm=False)[0].outputs[0].token_ids == plain[:-K]
