"""Phi-3 against HF transformers: fused qkv_proj / gate_up_proj checkpoints
(split by the layers' weight_loader, at T = 1 and T = 2) and LongRoPE.

The checkpoint is HF's own Phi3ForCausalLM with LongRoPE and an original
length of 48: every test prompt fits in it (so HF rotates it with the short
factors) and 32 generated tokens cross it (so later tokens take the long
ones), which is where HF and tracevllm must agree token for token. LongRoPE is
also checked on its own against HF's Phi3RotaryEmbedding.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.family_check import (
    PROMPT_LENS,
    check_against_hf,
    new_checkpoint_dir,
    save_hf_model,
    tiny_config_kwargs,
)

pytestmark = pytest.mark.timeout(600)

ORIGINAL_MAX = 48  # above the longest test prompt, below prompt + 32 tokens
HEAD_DIM = 16  # tiny_config_kwargs: hidden 64, 4 heads


def _factors(n: int, low: float, high: float, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    return sorted((low + (high - low) * torch.rand(n, generator=gen)).tolist())


def longrope_parameters(rotary_dim: int = HEAD_DIM, **extra: Any) -> dict[str, Any]:
    """Short factors near 1, long ones up to 12 (as Phi-3's grow with the wavelength)."""
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": _factors(rotary_dim // 2, 1.0, 1.5, seed=1),
        "long_factor": _factors(rotary_dim // 2, 1.0, 12.0, seed=2),
        **extra,
    }


def _phi3(tmp_path_factory: pytest.TempPathFactory, name: str, **overrides: Any) -> tuple[str, Any]:
    from transformers import Phi3Config, Phi3ForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, name)
    torch.manual_seed(0)
    config = Phi3Config(**tiny_config_kwargs(vocab_size, **overrides))
    model = Phi3ForCausalLM(config)
    save_hf_model(model, path)
    return path, model


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    assert max(PROMPT_LENS) <= ORIGINAL_MAX < min(PROMPT_LENS[3:]) + 32
    return _phi3(
        tmp_path_factory,
        "tiny-phi3-longrope",
        original_max_position_embeddings=ORIGINAL_MAX,
        rope_parameters=longrope_parameters(),
    )


def test_checkpoint_is_fused(phi3_longrope: tuple[str, Any]) -> None:
    """What makes the test about Phi-3: HF wrote qkv_proj and gate_up_proj whole."""
    from safetensors import safe_open

    with safe_open(f"{phi3_longrope[0]}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj" in n or ".gate_proj." in n for n in names)


@pytest.mark.parametrize("enable_multiprocessing", [False, True])
def test_phi3_longrope_matches_hf(
    phi3_longrope: tuple[str, Any], enable_multiprocessing: bool
) -> None:
    check_against_hf(*phi3_longrope, enable_multiprocessing=enable_multiprocessing)


def test_phi3_longrope_tp2_matches_hf(phi3_longrope: tuple[str, Any]) -> None:
    """Each rank takes its heads of the fused qkv_proj and its rows of gate and
    of up out of gate_up_proj (2 KV heads: one each)."""
    check_against_hf(
        *phi3_longrope,
        enable_multiprocessing=True,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )


def test_phi3_plain_rope_sliding_window_matches_hf(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Phi-3-mini-4k's shape: no rope scaling, a sliding window over the cache."""
    path, model = _phi3(tmp_path_factory, "tiny-phi3-default", sliding_window=24)
    assert model.config.rope_parameters["rope_type"] == "default"
    check_against_hf(path, model, enable_multiprocessing=False)


def test_phi3_is_registered_and_traced_as_llama(phi3_longrope: tuple[str, Any]) -> None:
    """The registry gives Phi3ForCausalLM; its forward is llama.py's, and so
    are its spans: the step's forward, a span per decoder layer at detail full
    holding that layer's KV write and read."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracevllm import LLM, SamplingParams
    from tracevllm.model_executor.models.phi3 import Phi3ForCausalLM
    from tracevllm.model_executor.models.registry import ModelRegistry

    assert ModelRegistry.resolve_model_cls(["Phi3ForCausalLM"]) == (
        Phi3ForCausalLM,
        "Phi3ForCausalLM",
    )
    exporter = InMemorySpanExporter()
    with LLM(model=phi3_longrope[0], enable_multiprocessing=False, trace_detail="full") as llm:
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    spans = exporter.get_finished_spans()

    def children(span: Any) -> list[Any]:
        return [s for s in spans if s.parent and s.parent.span_id == span.context.span_id]

    forwards = [s for s in spans if s.name == "LlamaForCausalLM.forward"]
    assert len(forwards) == 2  # prefill and one decode
    for forward in forwards:
        layers = children(forward)
        assert [s.name for s in layers] == ["LlamaDecoderLayer.forward"] * 2
        assert layers[0].attributes["code.file.path"].endswith("models/llama.py")
        for layer in layers:
            inside = [s.name for s in children(layer)]
            assert inside == ["reshape_and_cache_flash", "unified_attention"]


# LongRoPE on its own, against HF's rotary embedding.


def _hf_rotate(config: Any, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Any:
    """HF's Phi3RotaryEmbedding + apply_rotary_pos_emb on [tokens, heads * head_dim],
    all positions in one call (HF picks the factors from the largest)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    rope = Phi3RotaryEmbedding(config)
    n = positions.shape[0]
    q4 = q.view(1, n, -1, HEAD_DIM).transpose(1, 2)  # [1, heads, tokens, head_dim]
    k4 = k.view(1, n, -1, HEAD_DIM).transpose(1, 2)
    cos, sin = rope(q4, positions[None])
    q4, k4 = apply_rotary_pos_emb(q4, k4, cos, sin)
    return q4.transpose(1, 2).reshape(n, -1), k4.transpose(1, 2).reshape(n, -1)


@pytest.mark.parametrize(
    ("partial_rotary_factor", "extra"),
    [(1.0, {}), (0.5, {}), (1.0, {"attention_factor": 1.7}), (1.0, {"factor": 4.0})],
)
def test_longrope_equals_hf_rotary_embedding(
    partial_rotary_factor: float, extra: dict[str, Any]
) -> None:
    """Below the original length HF uses the short factors, past it the long
    ones; each equals ours on those positions, attention factor and partial
    rotary dims included."""
    from transformers import Phi3Config

    from tracevllm.model_executor.layers.rotary_embedding import (
        Phi3LongRoPEScaledRotaryEmbedding,
        get_rope,
    )

    rotary_dim = int(HEAD_DIM * partial_rotary_factor)
    config = Phi3Config(
        **tiny_config_kwargs(
            64,
            original_max_position_embeddings=ORIGINAL_MAX,
            rope_parameters=longrope_parameters(
                rotary_dim, partial_rotary_factor=partial_rotary_factor, **extra
            ),
        )
    )
    rope = get_rope(HEAD_DIM, config.max_position_embeddings, True, config.rope_parameters)
    assert isinstance(rope, Phi3LongRoPEScaledRotaryEmbedding)
    assert rope.rotary_dim == rotary_dim
    gen = torch.Generator().manual_seed(0)
    short = torch.arange(ORIGINAL_MAX)  # HF: largest + 1 <= original, short factors
    long = torch.arange(ORIGINAL_MAX, 3 * ORIGINAL_MAX)  # HF: long factors
    for positions in (short, long, long[torch.randperm(len(long), generator=gen)]):
        q = torch.randn(len(positions), 4 * HEAD_DIM, generator=gen)
        k = torch.randn(len(positions), 2 * HEAD_DIM, generator=gen)
        ours = rope(positions, q, k)
        theirs = _hf_rotate(config, positions, q, k)
        torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=1e-6)
        if rotary_dim < HEAD_DIM:  # the rest of each head passes through
            tail = q.view(len(positions), 4, HEAD_DIM)[..., rotary_dim:]
            assert torch.equal(ours[0].view(len(positions), 4, HEAD_DIM)[..., rotary_dim:], tail)


def test_longrope_attention_factor_and_switch_point() -> None:
    """sqrt(1 + ln(512 / 48) / ln(48)) on cos/sin; short rows end at position 47."""
    from tracevllm.model_executor.layers.rotary_embedding import get_rope

    params = longrope_parameters(original_max_position_embeddings=ORIGINAL_MAX)
    rope = get_rope(HEAD_DIM, 512, True, params)
    expected = math.sqrt(1 + math.log(512 / ORIGINAL_MAX) / math.log(ORIGINAL_MAX))
    assert rope.short_mscale == pytest.approx(expected)  # type: ignore[union-attr]
    cache = rope.cos_sin_cache
    # Position 0: cos = mscale, sin = 0 whatever the factors.
    torch.testing.assert_close(cache[0, : HEAD_DIM // 2], torch.full((HEAD_DIM // 2,), expected))
    # The lowest frequency (last factor) at position p: p / (factor * base ** (14 / 16)).
    for p, factor in ((ORIGINAL_MAX - 1, params["short_factor"][-1]),
                      (ORIGINAL_MAX, params["long_factor"][-1])):  # fmt: skip
        angle = p / (factor * 10000.0 ** (14 / 16))
        assert cache[p, HEAD_DIM // 2 - 1].item() == pytest.approx(
            math.cos(angle) * expected, rel=1e-5
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"short_factor": [1.0] * 7}, "rope_parameters.short_factor must be a list of 8 numbers"),
        ({"long_factor": [1.0] * 7 + [True]}, "rope_parameters.long_factor must hold positive"),
        ({"long_factor": [1.0] * 7 + [float("nan")]}, "rope_parameters.long_factor must hold"),
        ({"short_factor": [1.0] * 7 + [0.0]}, "rope_parameters.short_factor must hold positive"),
    ],
)
def test_longrope_bad_factors_are_refused(change: dict[str, Any], message: str) -> None:
    from tracevllm.model_executor.layers.rotary_embedding import get_rope

    params = longrope_parameters(original_max_position_embeddings=ORIGINAL_MAX) | change
    with pytest.raises(ValueError, match=message):
        get_rope(HEAD_DIM, 512, True, params)


def test_partial_rotary_without_longrope_is_refused() -> None:
    from tracevllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is supported"):
        get_rope(HEAD_DIM, 512, True, params)
