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
