"""Qwen2 and Qwen3 against HF transformers' own Qwen2ForCausalLM and
Qwen3ForCausalLM (tests/family_check.py).

Each tiny checkpoint is made so that what the family changes relative to
Llama shows in the tokens or the log-probabilities:

- Qwen2: the q/k/v biases drawn at random (HF starts them at zero, where a
  model without them would agree);
- Qwen2 with ``use_sliding_window`` and ``max_window_layers`` 1: layer 0 full,
  layer 1 sliding over 12 tokens (HF's ``layer_types``), so two KV cache
  groups and a block bound as tests/test_sliding_window.py checks it;
- Qwen3: ``head_dim`` 32 with 4 heads of a 64-wide model (not 64 / 4), the
  q_norm/k_norm weights drawn at random (HF starts them at one), tied embeddings.

Both also run on two tensor-parallel ranks (the mp executor), and their spans
are named after their own classes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tests.family_check as family_check
from tests.family_check import (
    BLOCK_SIZE,
    check_against_hf,
    hf_greedy,
    make_prompts,
    new_checkpoint_dir,
    save_hf_model,
    tiny_config_kwargs,
)
from tests.test_sliding_window import WINDOW, WindowBound
from tracevllm import LLM, SamplingParams
from tracevllm.utils.math_utils import cdiv


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-qwen2-family")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**tiny_config_kwargs(vocab_size))).eval()
    _randomize(model, (".q_proj.bias", ".k_proj.bias", ".v_proj.bias"), mean=0.0)
    save_hf_model(model, path)
    return path, model


@pytest.fixture(scope="module")
def qwen2_sliding(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-qwen2-sliding")
    torch.manual_seed(1)
    config = Qwen2Config(
        **tiny_config_kwargs(vocab_size),
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
    assert config.layer_types == ["full_attention", "sliding_attention"]
    model = Qwen2ForCausalLM(config).eval()
    _randomize(model, (".q_proj.bias", ".k_proj.bias", ".v_proj.bias"), mean=0.0)
    save_hf_model(model, path)
    return path, model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-qwen3-family")
    torch.manual_seed(0)
    config = Qwen3Config(**tiny_config_kwargs(vocab_size, head_dim=32, tie_word_embeddings=True))
    assert not config.attention_bias and config.layer_types == ["full_attention"] * 2
    model = Qwen3ForCausalLM(config).eval()
    _randomize(model, ("q_norm.weight", "k_norm.weight"), mean=1.0)
    save_hf_model(model, path)
    return path, model


def _randomize(model: Any, suffixes: tuple[str, ...], mean: float) -> None:
    """Draw the parameters HF starts at a constant (biases 0, norm weights 1)."""
    params = [p for name, p in model.named_parameters() if name.endswith(suffixes)]
    assert len(params) == len(suffixes) * model.config.num_hidden_layers
    with torch.no_grad():
        for param in params:
            param.normal_(mean, 0.5)


@pytest.mark.parametrize("enable_multiprocessing", [False, True])
def test_qwen2_matches_hf(qwen2: tuple[str, Any], enable_multiprocessing: bool) -> None:
    check_against_hf(*qwen2, enable_multiprocessing=enable_multiprocessing)


@pytest.mark.parametrize("enable_multiprocessing", [False, True])
def test_qwen3_matches_hf(qwen3: tuple[str, Any], enable_multiprocessing: bool) -> None:
    check_against_hf(*qwen3, enable_multiprocessing=enable_multiprocessing)


def _with_window_bound(bounds: list[WindowBound]) -> Callable[..., LLM]:
    """An ``LLM`` that checks the sliding group's block bound after every step."""

    def make(*args: Any, **kwargs: Any) -> LLM:
        llm = LLM(*args, **kwargs)
        bounds.append(WindowBound(llm.llm_engine.engine_core.engine_core))
        return llm

    return make


def test_qwen2_sliding_window_matches_hf(
    qwen2_sliding: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF's layer_types from use_sliding_window/max_window_layers: a full and a
    sliding KV cache group, the sliding one bounded to cdiv(W, bs) + 1 blocks."""
    bounds: list[WindowBound] = []
    monkeypatch.setattr(family_check, "LLM", _with_window_bound(bounds))
    check_against_hf(*qwen2_sliding, enable_multiprocessing=False)
    (bound,) = bounds
    assert bound.decode_steps > 0
    assert bound.max_held == cdiv(WINDOW, BLOCK_SIZE) + 1
    groups = bound.mgr.kv_cache_config.kv_cache_groups
    kinds = {type(g.kv_cache_spec).__name__: g.layer_names for g in groups}
    assert kinds == {
        "FullAttentionSpec": ["model.layers.0.self_attn.attn"],
        "SlidingWindowSpec": ["model.layers.1.self_attn.attn"],
    }


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_tensor_parallel_matches_hf(family: str, request: pytest.FixtureRequest) -> None:
    """Two ranks over the mp executor: heads (and the q/k/v biases with them),
    MLP and vocabulary split in two."""
    path, model = request.getfixturevalue(family)
    prompts = [make_prompts(model.config.vocab_size)[i] for i in (2, 4)]  # 13 and 20 tokens
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(
        model=path,
        block_size=BLOCK_SIZE,
        max_model_len=128,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, _ = hf_greedy(model, prompt, 16)
        assert list(output.outputs[0].token_ids) == tokens, f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize(("family", "cls"), [("qwen2", "Qwen2"), ("qwen3", "Qwen3")])
def test_qwen_spans(family: str, cls: str, request: pytest.FixtureRequest) -> None:
    """Llama's spans, named after the family's classes: the forward, and at
    detail full one span per decoder layer holding that layer's KV write and read."""
    path, _ = request.getfixturevalue(family)
    exporter = InMemorySpanExporter()
    with LLM(
        model=path, block_size=BLOCK_SIZE, enable_multiprocessing=False, trace_detail="full"
    ) as llm:
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    spans = exporter.get_finished_spans()

    def children(span: Any) -> list[Any]:
        return [s for s in spans if s.parent and s.parent.span_id == span.context.span_id]

    forwards = [s for s in spans if s.name == f"{cls}ForCausalLM.forward"]
    assert len(forwards) == 2  # prefill and one decode
    for forward in forwards:
        layers = children(forward)
        assert [s.name for s in layers] == [f"{cls}DecoderLayer.forward"] * 2
        assert [s.attributes["tracevllm.layer"] for s in layers] == [0, 1]
        assert layers[0].attributes["code.file.path"].endswith(f"models/{family}.py")
        for layer in layers:
            inside = [s.name for s in children(layer)]
            assert inside == ["reshape_and_cache_flash", "unified_attention"]
