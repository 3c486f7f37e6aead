"""Sliding-window attention through the engine, against HF transformers.

Two tiny random-weight checkpoints, written by HF's own model classes:

- a Mistral (every layer slides over the last W tokens): ``MistralForCausalLM``,
  which vLLM (and tracevllm's registry) runs as a Llama with
  ``cache_config.sliding_window``: one KV cache group of ``SlidingWindowSpec``;
- a hybrid of alternating sliding and full layers (Gemma-2's pattern, via HF's
  ``layer_types``): HF's Qwen2 with its q/k/v biases set to zero is exactly a
  Llama with per-layer windows, so its weights are saved as a Llama
  checkpoint with ``layer_types``: two KV cache groups
  (``HybridKVCacheCoordinator``, one block table per group in the runner).

Each runs with pages of 4 tokens, prompts longer than the window, chunked
prefill, prefix caching and a pool small enough to preempt, and must give HF's
greedy tokens with HF's log-probabilities (fp32 tolerance), while no request
holds more than ``cdiv(W, block_size) + 1`` blocks of a sliding group once it
decodes (asserted from the KV manager after every step).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.family_check import tiny_config_kwargs
from tests.utils import make_tiny_tokenizer
from tracevllm import LLM, SamplingParams
from tracevllm.core.single_type_kv_cache_manager import SlidingWindowManager
from tracevllm.utils.math_utils import cdiv

WINDOW = 12
BLOCK_SIZE = 4
NUM_TOKENS = 24
# Prompt lengths around and past the window; two share a 20-token prefix.
PROMPT_LENS = [5, 13, 30, 41, 20, 27]


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts[5] = prompts[4] + prompts[5][:7]  # a prefix hit past the window
    return prompts


def _save(model: Any, path: str, config_json: dict[str, Any] | None = None) -> None:
    """The model as an HF directory; ``config_json`` replaces its config.json."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path, safe_serialization=True)
    if config_json is not None:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config_json, f)
        # Without the (zero) q/k/v biases, which a Llama has not.
        state = {
            k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith("_proj.bias")
        }
        for name in os.listdir(path):
            if name.endswith(".safetensors"):
                os.remove(os.path.join(path, name))
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """A 2-layer Mistral with sliding_window = WINDOW, and HF's model of it."""
    from transformers import MistralConfig, MistralForCausalLM

    path = str(tmp_path_factory.mktemp("tiny-mistral"))
    tokenizer = make_tiny_tokenizer(path)
    torch.manual_seed(0)
    config = MistralConfig(
        **tiny_config_kwargs(len(tokenizer), num_hidden_layers=2, sliding_window=WINDOW)
    )
    model = MistralForCausalLM(config).eval()
    _save(model, path)
    return path, model


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """4 layers, sliding on even ones (Gemma-2's pattern): HF's Qwen2 with zero
    q/k/v biases, saved as a Llama checkpoint with layer_types."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = str(tmp_path_factory.mktemp("tiny-hybrid"))
    tokenizer = make_tiny_tokenizer(path)
    layer_types = ["sliding_attention", "full_attention"] * 2
    torch.manual_seed(1)
    config = Qwen2Config(
        **tiny_config_kwargs(len(tokenizer), num_hidden_layers=4),
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=0,
        layer_types=layer_types,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    llama = {
        **tiny_config_kwargs(len(tokenizer), num_hidden_layers=4),
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "layer_types": layer_types,
        "sliding_window": WINDOW,
        "torch_dtype": "float32",
    }
    _save(model, path, llama)
    return path, model


def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and the log-probability of each."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        float(torch.log_softmax(score[0].float(), -1)[t])
        for score, t in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


class WindowBound:
    """After every step: no decoding request holds more than cdiv(W, bs) + 1
    blocks of a sliding-window group, and the blocks it holds cover its
    window exactly (the ones before are the null block)."""

    def __init__(self, core: Any) -> None:
        sched = core.scheduler
        self.mgr = sched.kv_cache_manager
        self.sched = sched
        self.max_held = 0
        self.decode_steps = 0
        original = sched.update_from_output

        def checked(so: Any, out: Any) -> Any:
            result = original(so, out)
            self.check(so.num_scheduled_tokens)
            return result

        sched.update_from_output = checked

    def sliding_groups(self) -> list[int]:
        managers = self.mgr.coordinator.single_type_managers
        return [i for i, m in enumerate(managers) if isinstance(m, SlidingWindowManager)]

    def check(self, num_scheduled_tokens: dict[str, int]) -> None:
        bound = cdiv(WINDOW, BLOCK_SIZE) + 1
        for req in self.sched.running:
            if num_scheduled_tokens.get(req.request_id) != 1:
                continue  # a prefill chunk holds its window plus the chunk
            # Computed before this step: what allocate_slots freed the window to.
            computed = req.num_computed_tokens - 1
            self.decode_steps += 1
            block_ids = self.mgr.get_block_ids(req.request_id)
            for group in self.sliding_groups():
                ids = block_ids[group]
                held = [b for b in ids if b != 0]  # 0: the null block
                assert len(held) <= bound, (req.request_id, ids)
                self.max_held = max(self.max_held, len(held))
                # The step's token (position ``computed``) saw the W - 1 before it:
                # every block wholly before those is freed, none after.
                skipped = max(0, computed - WINDOW + 1)
                assert ids[: skipped // BLOCK_SIZE] == [0] * (skipped // BLOCK_SIZE)
                assert 0 not in ids[skipped // BLOCK_SIZE :], (req.request_id, ids)


def with_window_bound(bounds: list[WindowBound]) -> Callable[..., LLM]:
    """An ``LLM`` factory (for ``family_check.LLM``) whose engines check the
    sliding group's block bound after every step; each bound goes to ``bounds``."""

    def make(*args: Any, **kwargs: Any) -> LLM:
        llm = LLM(*args, **kwargs)
        bounds.append(WindowBound(llm.llm_engine.engine_core.engine_core))
        return llm

    return make


def _llm(path: str, **kwargs: Any) -> Iterator[LLM]:
    llm = LLM(
        model=path,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,  # chunked prefill
        max_num_seqs=4,
        enable_prefix_caching=True,
        **kwargs,
    )
    try:
        yield llm
    finally:
        llm.shutdown()


def _check_against_hf(path: str, model: Any, **kwargs: Any) -> tuple[LLM, WindowBound | None]:
    prompts = _prompts(model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    for llm in _llm(path, **kwargs):
        bound = None
        if not kwargs.get("enable_multiprocessing", True):
            bound = WindowBound(llm.llm_engine.engine_core.engine_core)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        num_preemptions = llm.llm_engine.num_preemptions
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(model, prompt, NUM_TOKENS)
        completion = output.outputs[0]
        assert list(completion.token_ids) == tokens, len(prompt)
        assert completion.logprobs is not None
        ours = [lp[t].logprob for lp, t in zip(completion.logprobs, tokens, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=0)
    # The shared 20-token prefix is a hit (more than the window: cached blocks
    # before the window are taken as null blocks when they are gone).
    assert outputs[5].num_cached_tokens >= WINDOW
    assert num_preemptions > 0
    return llm, bound


def test_mistral_matches_hf_with_a_bounded_window(mistral: tuple[str, Any]) -> None:
    """Every layer slides: one SlidingWindowSpec group. 12 blocks serve 4 requests
    of up to 65 tokens (full attention: 17 blocks each, and a 128-token model
    would not start)."""
    path, model = mistral
    llm, bound = _check_against_hf(
        path, model, enable_multiprocessing=False, num_gpu_blocks_override=12, max_model_len=128
    )
    assert bound is not None and bound.decode_steps > 0
    assert bound.max_held == cdiv(WINDOW, BLOCK_SIZE) + 1  # the bound is reached, not loose
    groups = bound.mgr.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec"]
    assert bound.mgr.coordinator.single_type_managers[0].num_skipped_blocks_freed > 0


@pytest.mark.parametrize("multiprocessing", [False, True], ids=["inproc", "mp"])
def test_hybrid_full_and_sliding_groups_match_hf(
    hybrid: tuple[str, Any], multiprocessing: bool
) -> None:
    """Alternating layers: two KV cache groups drawing from one pool, each
    layer reading its own group's block table and slots."""
    path, model = hybrid
    _, bound = _check_against_hf(
        path,
        model,
        enable_multiprocessing=multiprocessing,
        num_gpu_blocks_override=40,
        max_model_len=128,
    )
    if bound is not None:
        assert bound.decode_steps > 0
        groups = bound.mgr.kv_cache_config.kv_cache_groups
        kinds = {type(g.kv_cache_spec).__name__: g.layer_names for g in groups}
        assert kinds == {
            "SlidingWindowSpec": ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"],
            "FullAttentionSpec": ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"],
        }
        assert type(bound.mgr.coordinator).__name__ == "HybridKVCacheCoordinator"


def test_the_kv_view_shows_the_blocks_the_window_freed(
    hybrid: tuple[str, Any], tmp_path: Any
) -> None:
    """The step view (from the spans alone) gives each request a block list per
    group, the sliding group's freed blocks as the null block, and each group's
    running count; the block tables draw them as [freed x n]."""
    from rich.console import Console

    from tracevllm.tracing.attributes import SpanAttributes
    from tracevllm.tracing.exporters import read_spans_jsonl
    from tracevllm.views.report import STEP_SPAN
    from tracevllm.views.step import render_block_tables

    path, model = hybrid
    prompts = _prompts(model.config.vocab_size)[2:4]  # 30 and 41 tokens
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for llm in _llm(
        path, enable_multiprocessing=False, trace_detail="request", trace_dir=str(tmp_path)
    ):
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    views = [
        json.loads(s.attributes[SpanAttributes.STEP_VIEW])
        for s in read_spans_jsonl(f"{tmp_path}/spans.jsonl")
        if s.name == STEP_SPAN
    ]
    last = views[-1]
    groups = last["kv"]["groups"]
    assert [(g["kind"], g["sliding_window"]) for g in groups] == [
        ("SlidingWindowSpec", WINDOW),
        ("FullAttentionSpec", None),
    ]
    freed = [v["kv"]["groups"][0]["freed_by_window"] for v in views]
    assert freed == sorted(freed) and freed[-1] > 0 and groups[1]["freed_by_window"] == 0
    for req in last["requests"]:
        sliding, full = req["group_block_ids"]
        assert req["block_ids"] == sliding
        computed = req["num_computed_tokens"]  # before this step: what was freed to
        assert sliding.count(0) == max(0, computed - WINDOW + 1) // BLOCK_SIZE > 0
        assert 0 not in full and len(full) == len(sliding)
    console = Console(width=200, record=True)
    console.print(render_block_tables(last))
    text = console.export_text()
    assert "[freed x " in text and "sliding window 12" in text and "full attention" in text
    assert "blocks freed so far" in text
