"""The family check (tests/family_check.py) on Qwen3-MoE: HF's Qwen3MoeForCausalLM,
written by HF (one safetensors tensor per expert projection), 8 experts, top 2.

The first checkpoint renormalises the kept router weights (``norm_topk_prob``,
as Qwen3-30B-A3B) and makes layer 0 a dense MLP (``mlp_only_layers``), so both
kinds of layer run; the second keeps the raw softmax weights. Each is served by
one process and by the engine process, and the first by two TP ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.family_check import (
    check_against_hf,
    new_checkpoint_dir,
    save_hf_model,
    tiny_config_kwargs,
)


def _qwen3_moe(tmp_path_factory: pytest.TempPathFactory, name: str, **overrides: Any) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, name)
    config = Qwen3MoeConfig(
        **tiny_config_kwargs(
            vocab_size,
            head_dim=32,  # apart from hidden_size / num_heads (16), as Qwen3's
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            **overrides,
        )
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    # HF starts the router at zero (every expert tied): draw it like the other weights,
    # and give the per-head norms weights other than 1, so a lost q/k norm shows.
    with torch.no_grad():
        for name_, param in model.named_parameters():
            if name_.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            elif name_.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    save_hf_model(model, path)
    return path, model


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    return _qwen3_moe(  # type: ignore[no-any-return]
        tmp_path_factory, "tiny-qwen3-moe", norm_topk_prob=True, mlp_only_layers=[0]
    )


@pytest.fixture(scope="module")
def qwen3_moe_raw_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    return _qwen3_moe(tmp_path_factory, "tiny-qwen3-moe-raw", norm_topk_prob=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize("enable_multiprocessing", [False, True])
def test_qwen3_moe_matches_hf(qwen3_moe: tuple[str, Any], enable_multiprocessing: bool) -> None:
    check_against_hf(*qwen3_moe, enable_multiprocessing=enable_multiprocessing)


@pytest.mark.parametrize("enable_multiprocessing", [False, True])
def test_qwen3_moe_without_renormalising_matches_hf(
    qwen3_moe_raw_weights: tuple[str, Any], enable_multiprocessing: bool
) -> None:
    check_against_hf(*qwen3_moe_raw_weights, enable_multiprocessing=enable_multiprocessing)


def test_qwen3_moe_tensor_parallel_matches_hf(qwen3_moe: tuple[str, Any]) -> None:
    """Two ranks, each with every expert's half of the intermediate dimension."""
    check_against_hf(
        *qwen3_moe,
        enable_multiprocessing=True,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )


def test_qwen3_moe_spans_count_each_experts_tokens(qwen3_moe: tuple[str, Any]) -> None:
    """At detail "full" each sparse layer's FusedMoE.forward span sits in its
    Qwen3MoeDecoderLayer.forward span and counts the tokens its experts got: every
    token forwarded, top_k times. The dense layer 0 has none."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracevllm import LLM, SamplingParams

    path, hf_model = qwen3_moe
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    max_tokens = 4
    exporter = InMemorySpanExporter()
    with LLM(
        model=path, enable_multiprocessing=False, enable_prefix_caching=False, trace_detail="full"
    ) as llm:
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    spans = list(exporter.get_finished_spans())
    by_id = {s.context.span_id: s for s in spans}
    moe = [s for s in spans if s.name == "FusedMoE.forward"]
    assert moe and {s.attributes["tracevllm.layer"] for s in moe} == {1}
    for span in moe:
        parent = by_id[span.parent.span_id]
        assert parent.name == "Qwen3MoeDecoderLayer.forward"
        assert parent.attributes["tracevllm.layer"] == 1
        assert span.attributes["tracevllm.layer_name"] == "model.layers.1.mlp.experts"
        assert len(span.attributes["tracevllm.moe.tokens_per_expert"]) == 8
    # Every prompt token and every generated one but the last went through the layer.
    forwarded = sum(len(p) for p in prompts) + len(prompts) * (max_tokens - 1)
    counted = sum(sum(s.attributes["tracevllm.moe.tokens_per_expert"]) for s in moe)
    assert counted == forwarded * hf_model.config.num_experts_per_tok
    assert any(s.name == "Qwen3MoeForCausalLM.forward" for s in spans)
