"""The CPU GEMM dispatch: weights packed once for oneDNN give F.linear's result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.parallel_utils import init_world_of_one
from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from tracevllm.model_executor.layers.linear import ReplicatedLinear
from tracevllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from tracevllm.model_executor.model_loader import get_model

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_packed_linear_matches_f_linear(bias: bool, num_tokens: int) -> None:
    torch.manual_seed(0)
    layer = ReplicatedLinear(96, 160, bias=bias)
    # Weights start as torch.empty (the loader fills them): give them values.
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_()
    weight = layer.weight.detach().clone()
    b = layer.bias.detach().clone() if bias else None
    x = torch.randn(num_tokens, 96)
    layer.process_weights_after_loading()
    # Packed: the plain weight is gone, the matmul goes through oneDNN.
    assert layer.cpu_linear is not F.linear
    assert layer.weight.numel() == 0
    out, out_bias = layer(x)  # vLLM's (output, bias-if-skip_bias_add)
    assert out_bias is None
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_tied_lm_head_packs_and_embedding_keeps_its_weight() -> None:
    init_world_of_one()
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(50, 32)  # padded to 64 rows
    with torch.no_grad():
        emb.weight.normal_()
    head = ParallelLMHead(50, 32).tie_weights(emb)
    assert head.weight is emb.weight
    weight = emb.weight.detach().clone()
    head.process_weights_after_loading()
    # The head's plain reference is gone (one packed copy); the embedding still looks up.
    assert head.weight.numel() == 0 and emb.weight.shape == (64, 32)
    ids = torch.tensor([3, 49, 0])
    torch.testing.assert_close(emb(ids), weight[ids])
    h = torch.randn(4, 32)
    torch.testing.assert_close(head.cpu_linear(h, head.weight, None), h @ weight.T)


def test_switch_off_keeps_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEVLLM_CPU_ONEDNN_GEMM", "0")
    layer = ReplicatedLinear(8, 4)
    layer.process_weights_after_loading()
    assert layer.cpu_linear is F.linear
    assert layer.weight.shape == (4, 8)


@needs_onednn
def test_loaded_model_is_packed(tiny_model_dir: str) -> None:
    init_world_of_one()
    model = get_model(
        VllmConfig(ModelConfig(model=tiny_model_dir), CacheConfig(), SchedulerConfig())
    )
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert linear.cpu_linear is not F.linear
        assert linear.weight.numel() == 0
    assert model.lm_head.cpu_linear is not F.linear
