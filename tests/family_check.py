"""One check for every model family: a tiny random-weight checkpoint, written
by HF transformers' own model class, served by tracevllm must give HF's greedy
tokens token for token and HF's log-probabilities within fp32 tolerance: the
chosen token's and each step's top 5 (the logits, up to their log-sum-exp).

``check_against_hf(path, hf_model)`` runs 8 prompts x 32 tokens with pages of
4 tokens, chunked prefill (16 tokens a step), prefix caching (two prompts
share a 20-token prefix, and the second must hit it) and a pool small enough
that requests are preempted (asserted), in the process mode asked for. The
reference is HF's forward with its own KV cache, greedy, in fp32.

A family's test module writes its checkpoint once (a module fixture with
``save_hf_model``), then calls ``check_against_hf`` for both process modes.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.utils import make_tiny_tokenizer
from tracevllm import LLM, SamplingParams

BLOCK_SIZE = 4
NUM_TOKENS = 32
# Prompt lengths from one token to several chunks; the last two share a prefix.
PROMPT_LENS = [1, 5, 13, 30, 41, 20, 20, 27]
# Log-probabilities compared per step: the chosen token's and the top ones.
TOP_LOGPROBS = 5


def tiny_config_kwargs(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """What every family's tiny config shares (HF's field names)."""
    return (
        dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            initializer_range=0.1,  # logits spread out: no near-ties in greedy decoding
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        | overrides
    )


def new_checkpoint_dir(tmp_path_factory: Any, name: str) -> tuple[str, int]:
    """A fresh directory holding the tiny tokenizer; returns it and the vocab size."""
    path = str(tmp_path_factory.mktemp(name))
    tokenizer = make_tiny_tokenizer(path)
    return path, len(tokenizer)


def save_hf_model(model: Any, path: str) -> None:
    """HF's model, saved as HF saves it (safetensors, config.json)."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path, safe_serialization=True)


def make_prompts(vocab_size: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts[7] = prompts[6] + prompts[7][:7]  # a 20-token prefix hit
    return prompts


# Every log-probability row HF computed, by (model, prompt, n): hf_greedy
# keeps them here so check_against_hf can compare more than the chosen token's
# (a test may wrap hf_greedy in a cache; the rows stay found).
HF_LOGPROB_ROWS: dict[tuple[int, tuple[int, ...], int], torch.Tensor] = {}


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens (ignoring EOS) and the log-probability of each."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    for _ in range(n):
        row = torch.log_softmax(out.logits[0, -1].float(), -1)
        token = int(row.argmax())
        tokens.append(token)
        rows.append(row)
        out = model(
            input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
        )
    HF_LOGPROB_ROWS[(id(model), tuple(prompt), n)] = torch.stack(rows)
    return tokens, [float(row[t]) for row, t in zip(rows, tokens, strict=True)]


def check_against_hf(
    path: str,
    hf_model: Any,
    enable_multiprocessing: bool,
    num_gpu_blocks_override: int = 40,
    atol: float = 1e-4,
    **llm_kwargs: Any,
) -> LLM:
    """Serve ``path`` with tracevllm and compare with ``hf_model`` (see the module
    docstring). Returns the (shut down) LLM, for tests that look further."""
    prompts = make_prompts(hf_model.config.vocab_size)
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    llm = LLM(
        model=path,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,  # chunked prefill
        max_num_seqs=8,
        enable_prefix_caching=True,
        num_gpu_blocks_override=num_gpu_blocks_override,  # small: requests get preempted
        max_model_len=128,  # the start-up check: one such request fits the small pool
        enable_multiprocessing=enable_multiprocessing,
        **llm_kwargs,
    )
    try:
        one_rank = llm.llm_engine.vllm_config.parallel_config.world_size == 1
        if not enable_multiprocessing and one_rank:
            # The forward the thread count's warm-up probe times
            # (cpu_threads.probe_at_warm_up): no attention metadata. It must
            # run for every family and leave nothing that changes the outputs.
            executor = llm.llm_engine.engine_core.engine_core.model_executor
            runner = executor.driver_worker.worker.model_runner
            runner._dummy_run(runner.max_num_tokens)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        num_preemptions = llm.llm_engine.num_preemptions
    finally:
        llm.shutdown()
    hf_model.eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(hf_model, prompt, NUM_TOKENS)
        completion = output.outputs[0]
        assert list(completion.token_ids) == tokens, f"prompt of {len(prompt)} tokens"
        assert completion.logprobs is not None
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, tokens, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=atol, rtol=0)
        # Beyond the chosen token: each step's top TOP_LOGPROBS, ids and values,
        # against HF's row (the logits up to their log-sum-exp).
        rows = HF_LOGPROB_ROWS[(id(hf_model), tuple(prompt), NUM_TOKENS)]
        for step, (lp, row) in enumerate(zip(completion.logprobs, rows, strict=True)):
            ids = sorted(lp)
            assert len(ids) >= TOP_LOGPROBS, (step, lp)
            ours_row = torch.tensor([lp[i].logprob for i in ids])
            torch.testing.assert_close(ours_row, row[ids], atol=atol, rtol=0)
            # Ours are HF's top ones: none below HF's k-th largest (up to atol).
            assert float(row[ids].min()) >= float(row.topk(TOP_LOGPROBS).values[-1]) - atol
    assert outputs[7].num_cached_tokens >= 16, "the shared prefix was not a cache hit"
    assert num_preemptions > 0, "no request was preempted: make the pool smaller"
    return llm
