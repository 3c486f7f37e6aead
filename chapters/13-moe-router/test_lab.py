"""Lab 13 tests: fused_topk by hand, against the definition, and in the real FusedMoE layer."""

from __future__ import annotations

import math

import pytest
import torch
from _labkit import load

fused_topk = load(__file__, "fused_topk")


def logits_of(probs: list[list[float]]) -> torch.Tensor:
    """Logits whose softmax is ``probs`` (each row sums to 1)."""
    return torch.tensor([[math.log(p) for p in row] for row in probs])


def route(logits: torch.Tensor, topk: int, renormalize: bool, **kwargs: object) -> tuple:
    hidden = torch.zeros(logits.shape[0], 8)
    return fused_topk(hidden, logits, topk, renormalize, **kwargs)  # type: ignore[no-any-return]


def slow_route(
    logits: torch.Tensor, topk: int, renormalize: bool, scoring_func: str = "softmax"
) -> tuple[list[list[int]], list[list[float]]]:
    """Token by token, in float64: the definition."""
    ids, weights = [], []
    for row in logits.double():
        scores = row.softmax(-1) if scoring_func == "softmax" else row.sigmoid()
        best = sorted(range(len(scores)), key=lambda e: -float(scores[e]))[:topk]
        kept = [float(scores[e]) for e in best]
        total = sum(kept)
        ids.append(best)
        weights.append([w / total for w in kept] if renormalize else kept)
    return ids, weights


def test_one_token_by_hand() -> None:
    # Probabilities 0.1 0.2 0.3 0.4 over 4 experts; top-2 keeps experts 3 and 2.
    logits = logits_of([[0.1, 0.2, 0.3, 0.4]])
    weights, ids, _ = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 2]]  # best first
    assert torch.allclose(weights, torch.tensor([[0.4, 0.3]]))
    # Renormalised: 0.4 / 0.7 and 0.3 / 0.7, summing to 1.
    weights, ids, _ = route(logits, 2, renormalize=True)
    assert ids.tolist() == [[3, 2]]
    assert torch.allclose(weights, torch.tensor([[4 / 7, 3 / 7]]))


def test_top_1_renormalised_is_weight_one() -> None:
    logits = logits_of([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    weights, ids, _ = route(logits, 1, renormalize=True)
    assert ids.tolist() == [[0], [2]]
    assert weights.tolist() == [[1.0], [1.0]]


def test_rows_are_tokens_each_routed_alone() -> None:
    logits = logits_of([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.5, 0.125, 0.125]])
    weights, ids, _ = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 2], [0, 1], [1, 0]]
    assert torch.allclose(weights, torch.tensor([[0.4, 0.3], [0.4, 0.3], [0.5, 0.25]]))


def test_sigmoid_scores_each_expert_alone() -> None:
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    weights, ids, _ = route(logits, 2, renormalize=False, scoring_func="sigmoid")
    assert ids.tolist() == [[1, 3]]
    expected = torch.sigmoid(torch.tensor([[2.0, 1.0]]))
    assert torch.allclose(weights, expected)  # not a softmax: they need not sum to 1
    weights, _, _ = route(logits, 2, renormalize=True, scoring_func="sigmoid")
    assert torch.allclose(weights, expected / expected.sum())


def test_dtypes_and_the_token_expert_indices() -> None:
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weights, ids, token_expert_indices = route(logits, 3, renormalize=True)
    assert weights.dtype == torch.float32  # scores in fp32, whatever the logits' dtype
    assert ids.dtype == torch.int32 and token_expert_indices.dtype == torch.int32
    assert weights.shape == ids.shape == token_expert_indices.shape == (5, 3)
    # (token t, choice k) -> row k * num_tokens + t of a k-major layout.
    assert token_expert_indices.tolist() == [[t, 5 + t, 10 + t] for t in range(5)]
    _, ids, _ = route(logits, 3, renormalize=True, indices_type=torch.int64)
    assert ids.dtype == torch.int64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"topk": 0}, "topk must be an int in"),
        ({"topk": 7}, "topk must be an int in"),
        ({"topk": True}, "topk must be an int in"),
        ({"scoring_func": "softplus"}, "Unsupported scoring function: softplus"),
        ({"num_tokens": 3}, "Number of tokens mismatch"),
    ],
)
def test_refuses_what_cannot_be_routed(kwargs: dict, match: str) -> None:
    logits = torch.randn(4, 6)
    hidden = torch.zeros(kwargs.pop("num_tokens", 4), 8)
    args = {"topk": 2, "renormalize": True, **kwargs}
    with pytest.raises(ValueError, match=match):
        fused_topk(hidden, logits, args.pop("topk"), args.pop("renormalize"), **args)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_random_batch_against_the_definition(renormalize: bool, scoring_func: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 16, generator=gen) * 2
    weights, ids, _ = route(logits, 4, renormalize, scoring_func=scoring_func)
    want_ids, want_weights = slow_route(logits, 4, renormalize, scoring_func)
    assert ids.tolist() == want_ids
    assert torch.allclose(
        weights.double(), torch.tensor(want_weights, dtype=torch.float64), atol=1e-6
    )


def test_the_real_fused_moe_layer_agrees() -> None:
    """Your routing through the engine's experts gives the FusedMoE layer's output."""
    from tracevllm.model_executor.layers.fused_moe import FusedMoE, fused_experts

    torch.manual_seed(0)
    num_experts, top_k, hidden_size, intermediate = 8, 2, 16, 12
    layer = FusedMoE(num_experts, top_k, hidden_size, intermediate, tp_size=1)
    with torch.no_grad():
        layer.w13_weight.normal_(0, 0.2)
        layer.w2_weight.normal_(0, 0.2)
    hidden = torch.randn(10, hidden_size)  # [num_tokens, hidden_size]
    router_logits = torch.randn(10, num_experts) * 2  # [num_tokens, num_experts]
    expected = layer(hidden, router_logits)  # the engine's own router inside
    weights, ids, _ = fused_topk(hidden, router_logits, top_k, True)
    got = fused_experts(hidden, layer.w13_weight, layer.w2_weight, weights, ids)
    assert torch.allclose(got, expected, atol=1e-5)
