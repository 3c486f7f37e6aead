"""Lossless speculative decoding on the real default model: greedy output with
drafts equals greedy output without, token for token (or differs first at a
true near-tie, which is reported), 8 chat prompts x 64 tokens, for n-gram
drafts (k = 2, 4) and a draft model (on every other prompt: the default model
drafting for itself keeps every draft; a tiny random-weight one keeps almost
none), and with chunked prefill, prefix-cache hits and a forced preemption in
the same run."""

from __future__ import annotations

from typing import Any

import pytest

from tests.reference import GreedyReference, assert_lossless
from tests.test_lossless import QUESTIONS, conversation
from tests.test_spec_decode_engine import StepChecker
from tracevllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def ngram(k: int) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4}  # fmt: skip


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                conversation(q), add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def references(prompt_ids: list[list[int]]) -> list[GreedyReference]:
    """Greedy without drafts (itself equal to HF's, test_lossless.py), with
    the top-2 logprob gap at each position to tell a near-tie from a bug."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    with LLM(enable_multiprocessing=False) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False
        )
    refs = []
    for out in outputs:
        completion = out.outputs[0]
        assert completion.logprobs is not None
        gaps = []
        for position in completion.logprobs:
            top = sorted((lp.logprob for lp in position.values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        refs.append(GreedyReference(completion.token_ids, gaps))
    return refs


# A draft model costs a forward per draft token: its tests run every other
# prompt (four, in one batch), with their references.
DRAFT_MODEL_PROMPTS = slice(0, None, 2)


def _run(prompt_ids: list[list[int]], refs: list[GreedyReference], what: str, **kw: Any):
    assert len(prompt_ids) == len(refs)
    with LLM(enable_multiprocessing=False, **kw) as llm:
        checker = StepChecker(llm.llm_engine.engine_core.engine_core)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False
        )
        num_preemptions = llm.llm_engine.num_preemptions
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        assert_lossless(out.outputs[0].token_ids, ref, f"{what}, prompt {i}")
    return outputs, checker, num_preemptions


@pytest.mark.parametrize("k", [2, 4])
def test_ngram_is_lossless(prompt_ids: Any, references: Any, k: int) -> None:
    _, checker, _ = _run(prompt_ids, references, f"ngram k={k}", speculative_config=ngram(k))
    assert checker.accepted > 0 and checker.max_emitted > 1


def test_the_model_drafting_for_itself_keeps_every_draft(
    default_model_dir: str, prompt_ids: Any, references: Any
) -> None:
    spec = {"method": "draft_model", "model": default_model_dir, "num_speculative_tokens": 3}
    some = DRAFT_MODEL_PROMPTS
    _, checker, _ = _run(prompt_ids[some], references[some], "self-draft", speculative_config=spec)
    assert checker.drafted > 0 and checker.acceptance_rate == 1.0


def test_a_random_draft_model_keeps_almost_nothing(
    tiny_model_dir: str, prompt_ids: Any, references: Any
) -> None:
    spec = {"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": 2}
    some = DRAFT_MODEL_PROMPTS
    _, checker, _ = _run(prompt_ids[some], references[some], "tiny draft", speculative_config=spec)
    assert checker.drafted > 0 and checker.acceptance_rate < 0.05


def test_lossless_with_chunks_prefix_hits_and_preemption(prompt_ids: Any, references: Any) -> None:
    """16 tokens a step, room for about three requests, and the shared system
    prompt's blocks hit in the cache, in one n-gram run."""
    longest = max(len(p) for p in prompt_ids) + MAX_TOKENS
    blocks = 3 * (-(-longest // 16)) + 1
    outputs, checker, preemptions = _run(
        prompt_ids,
        references,
        "ngram, chunks + hits + preemption",
        speculative_config=ngram(4),
        max_num_batched_tokens=16,
        num_gpu_blocks_override=blocks,
        max_model_len=blocks * 16,
    )
    assert preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in outputs)
    assert checker.accepted > 0


# The structured-output case: a JSON schema beside a plain request. The
# schema is in the prompt, so n-gram drafts find the keys there.
STRUCTURED_SUBJECTS = 4


def _structured_workload() -> tuple[list[Any], list[SamplingParams]]:
    import json

    from tests.structured_cases import FLAT, SUBJECTS
    from tracevllm.sampling_params import StructuredOutputsParams

    messages = [
        [{"role": "user", "content": f"Describe a person who lives in {s} as JSON with the "
                                     f"schema {json.dumps(FLAT)}."}]
        for s in SUBJECTS[:STRUCTURED_SUBJECTS]
    ] + [[{"role": "user", "content": "Why is the sky blue?"}]]  # fmt: skip
    structured = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=FLAT)
    )
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return messages, [structured] * STRUCTURED_SUBJECTS + [plain]


@pytest.fixture(scope="module")
def structured_without_drafts() -> list[Any]:
    """The structured workload without drafts: what both drafting runs must give."""
    messages, params = _structured_workload()
    with LLM(enable_multiprocessing=False) as llm:
        return llm.chat(messages, params, use_tqdm=False)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_structured_outputs_with_drafts(
    default_model_dir: str, structured_without_drafts: list[Any], method: str
) -> None:
    """A JSON schema beside a plain request: with drafts, each draft position
    is masked by the grammar as it would stand after the drafts before it
    (the bitmask has a row per position), drafts the grammar refuses are
    dropped before they are scheduled, and the output is the same valid
    JSON as without drafts (that run shared by both methods)."""
    import json

    import jsonschema

    from tests.structured_cases import FLAT

    spec = (
        ngram(4)
        if method == "ngram"
        else {"method": "draft_model", "model": default_model_dir, "num_speculative_tokens": 3}
    )
    messages, params = _structured_workload()
    with LLM(enable_multiprocessing=False, speculative_config=spec) as llm:
        checker = StepChecker(llm.llm_engine.engine_core.engine_core)
        drafted = llm.chat(messages, params, use_tqdm=False)
    assert checker.accepted > 0
    for a, b in zip(structured_without_drafts, drafted, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for out in drafted[:STRUCTURED_SUBJECTS]:
        jsonschema.validate(json.loads(out.outputs[0].text), FLAT)
