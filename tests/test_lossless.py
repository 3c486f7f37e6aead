"""Lossless: greedy output on the real default model equals HF transformers,
token for token, in every engine configuration that changes how work is cut
up (processes, chunked prefill, prefix-cache hits, preemption, block size)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.reference import GreedyReference, assert_lossless, hf_greedy
from tracevllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
SYSTEM = "You are a concise assistant. Answer in plain English, in two or three sentences."
QUESTIONS = [
    "What is the capital of France?",
    "Explain what a KV cache is in a language model.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Give me three tips for learning Python.",
    "What is 17 times 23? Show your working.",
    "Translate 'good morning, friends' into Spanish.",
    "Describe how a bicycle works.",
]


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    # As LLM.chat does: render the template, then tokenize without adding
    # special tokens a second time.
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
def hf_model(default_model_dir: str) -> Any:
    """HF transformers' Llama on the same weights, fp32: the reference for every test here."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def references(hf_model: Any, prompt_ids: list[list[int]]) -> list[GreedyReference]:
    return [hf_greedy(hf_model, ids, MAX_TOKENS) for ids in prompt_ids]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _check(llm: LLM, prompt_ids: list[list[int]], refs: list[GreedyReference], what: str):
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        assert_lossless(out.outputs[0].token_ids, ref, f"{what}, prompt {i}")
    return outputs


@pytest.mark.parametrize("multiprocessing", [True, False], ids=["mp", "inproc"])
def test_lossless_default(
    default_model_dir: str, prompt_ids: Any, references: Any, multiprocessing: bool
) -> None:
    with LLM(enable_multiprocessing=multiprocessing) as llm:
        _check(llm, prompt_ids, references, f"default, mp={multiprocessing}")
        # (b) the same prompts again: their blocks are in the prefix cache now.
        again = _check(llm, prompt_ids, references, "prefix-cache hits")
        assert all(o.num_cached_tokens > 0 for o in again)


def test_lossless_chunked_prefill(default_model_dir: str, prompt_ids: Any, references: Any):
    # (a) 16 tokens a step for everyone: every prompt is cut into chunks.
    with LLM(max_num_batched_tokens=16, enable_multiprocessing=False) as llm:
        _check(llm, prompt_ids, references, "chunked prefill")


def test_lossless_preemption(default_model_dir: str, prompt_ids: Any, references: Any):
    # (c) room for about three requests at a time: the scheduler must preempt.
    longest = max(len(p) for p in prompt_ids) + MAX_TOKENS
    blocks = 3 * (-(-longest // 16)) + 1
    with LLM(
        num_gpu_blocks_override=blocks, max_model_len=blocks * 16, enable_multiprocessing=False
    ) as llm:
        _check(llm, prompt_ids, references, "preemption")
        assert llm.llm_engine.num_preemptions > 0


def test_penalties_match_hf(
    hf_model: Any, prompt_ids: Any, references: list[GreedyReference]
) -> None:
    """Greedy with penalties, beside a request without: each equals its HF reference.

    The repetition penalty is HF's own ``RepetitionPenaltyLogitsProcessor`` in
    the reference loop; frequency and presence follow the OpenAI definition
    (generated tokens only), applied after it, in vLLM's order.
    """
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    def processor(repetition: float, frequency: float, presence: float) -> Any:
        hf = RepetitionPenaltyLogitsProcessor(penalty=repetition)

        def apply(prompt: list[int], generated: list[int], logits: torch.Tensor) -> torch.Tensor:
            logits = hf(torch.tensor([prompt + generated]), logits[None])[0]
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long),
                                    minlength=logits.shape[0]).float()  # fmt: skip
            return logits - frequency * counts - presence * (counts > 0).float()

        return apply

    knobs = [(1.3, 0.0, 0.0), None, (1.1, 0.5, 0.4)]  # None: a plain greedy neighbour
    refs = [
        references[i]
        if k is None
        else hf_greedy(hf_model, prompt_ids[i], MAX_TOKENS, processor(*k))
        for i, k in enumerate(knobs)
    ]
    params = [
        GREEDY
        if k is None
        else SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            repetition_penalty=k[0],
            frequency_penalty=k[1],
            presence_penalty=k[2],
        )
        for k in knobs
    ]
    with LLM(enable_multiprocessing=False) as llm:
        prompts = [{"prompt_token_ids": p} for p in prompt_ids[: len(knobs)]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        assert_lossless(out.outputs[0].token_ids, ref, f"penalties {knobs[i]}, prompt {i}")
    # The penalties changed something: otherwise this test would prove nothing.
    assert outputs[0].outputs[0].token_ids != references[0].token_ids
    assert outputs[2].outputs[0].token_ids != references[2].token_ids


def test_min_tokens_masks_eos_as_hf_does(hf_model: Any, tokenizer: Any) -> None:
    """min_tokens forbids EOS until that many tokens exist (vLLM's MinTokensLogitsProcessor),
    so greedy runs past where it would stop; equal to HF's greedy under its own
    ``MinNewTokensLengthLogitsProcessor``."""
    import torch
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    messages = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    eos, min_tokens, max_tokens = tokenizer.eos_token_id, 12, 24
    with LLM(enable_multiprocessing=False) as llm:
        plain, held, ignored = llm.generate(
            [{"prompt_token_ids": prompt}] * 3,
            [
                SamplingParams(temperature=0.0, max_tokens=max_tokens),
                SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min_tokens),
                # ignore_eos does not lift the mask: EOS is still held back
                # until min_tokens (vLLM keeps it among all_stop_token_ids).
                SamplingParams(
                    temperature=0.0, max_tokens=min_tokens, min_tokens=min_tokens, ignore_eos=True
                ),
            ],
            use_tqdm=False,
        )
    plain_ids, held_ids = plain.outputs[0].token_ids, held.outputs[0].token_ids
    assert plain_ids[-1] == eos and len(plain_ids) < min_tokens  # stops early unheld
    assert eos not in held_ids[:min_tokens] and len(held_ids) > min_tokens
    assert ignored.outputs[0].token_ids == held_ids[:min_tokens]

    hf_min = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, eos)

    def processor(prompt: list[int], generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        return hf_min(torch.tensor([prompt + generated]), logits[None])[0]

    ref = hf_greedy(hf_model, prompt, len(held_ids), processor)
    assert_lossless(held_ids, ref, "min_tokens")


def test_lossless_block_size_32(default_model_dir: str, prompt_ids: Any, references: Any):
    # (d) a bigger page: different slot_mapping and block tables, same tokens.
    with LLM(block_size=32, enable_multiprocessing=True) as llm:
        _check(llm, prompt_ids, references, "block_size 32")
