"""Phi-3 against HF transformers: fused qkv_proj / gate_up_proj checkpoints
(split by the layers' weight_loader, at T = 1 and T = 2) and LongRoPE.

LongRoPE's factors follow vLLM's rule: long for every token when
max_model_len exceeds original_max_position_embeddings, short otherwise.
HF picks per forward call (long iff its largest position + 1 exceeds the
original length), so the two are compared where they must agree, each case a
checkpoint of HF's own Phi3ForCausalLM:

- short: original 128 = max_model_len, and every prompt + 32 generated
  tokens (at most 73) within it: short factors throughout, in both;
- long: original 4 < max_model_len 128, and every prompt longer than 4
  tokens (the 1-token one of family_check's set replaced): HF's first
  forward already runs past the original length, so it is long throughout.

LongRoPE is also checked on its own against HF's Phi3RotaryEmbedding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests import family_check
from tests.family_check import (
    PROMPT_LENS,
    check_against_hf,
    new_checkpoint_dir,
    save_hf_model,
    tiny_config_kwargs,
)

pytestmark = pytest.mark.timeout(600)

MAX_MODEL_LEN = 128  # what check_against_hf gives the engine
SHORT_ORIGINAL = 128  # = max_model_len: the short factors
LONG_ORIGINAL = 4  # < max_model_len: the long factors
# family_check's prompt lengths with the 1-token prompt made 9: HF rotates a
# prompt of at most LONG_ORIGINAL tokens with the short factors.
LONG_PROMPT_LENS = [9 if n == 1 else n for n in PROMPT_LENS]
ORIGINAL_MAX = 48  # the rotary embedding's own tests
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
def phi3_short(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    assert max(PROMPT_LENS) + family_check.NUM_TOKENS <= SHORT_ORIGINAL == MAX_MODEL_LEN
    return _phi3(
        tmp_path_factory,
        "tiny-phi3-longrope-short",
        original_max_position_embeddings=SHORT_ORIGINAL,
        rope_parameters=longrope_parameters(),
    )


@pytest.fixture(scope="module")
def phi3_long(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    return _phi3(
        tmp_path_factory,
        "tiny-phi3-longrope-long",
        original_max_position_embeddings=LONG_ORIGINAL,
        rope_parameters=longrope_parameters(),
    )


@pytest.fixture
def long_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_against_hf's prompts, every one longer than LONG_ORIGINAL."""
    assert min(LONG_PROMPT_LENS) > LONG_ORIGINAL and MAX_MODEL_LEN > LONG_ORIGINAL
    monkeypatch.setattr(family_check, "PROMPT_LENS", LONG_PROMPT_LENS)


def test_checkpoint_is_fused(phi3_short: tuple[str, Any]) -> None:
    """What makes the test about Phi-3: HF wrote qkv_proj and gate_up_proj whole."""
    from safetensors import safe_open

    with safe_open(f"{phi3_short[0]}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj" in n or ".gate_proj." in n for n in names)


def test_phi3_longrope_short_matches_hf(phi3_short: tuple[str, Any]) -> None:
    """max_model_len <= original: short factors, as HF within the original length."""
    check_against_hf(*phi3_short, enable_multiprocessing=False)


@pytest.mark.usefixtures("long_prompts")
@pytest.mark.parametrize("enable_multiprocessing", [False, True])
def test_phi3_longrope_long_matches_hf(
    phi3_long: tuple[str, Any], enable_multiprocessing: bool
) -> None:
    """max_model_len > original: long factors for every token, prompt included,
    as HF for a prompt past the original length."""
    check_against_hf(*phi3_long, enable_multiprocessing=enable_multiprocessing)


@pytest.mark.usefixtures("long_prompts")
def test_phi3_longrope_tp2_matches_hf(phi3_long: tuple[str, Any]) -> None:
    """Each rank takes its heads of the fused qkv_proj and its rows of gate and
    of up out of gate_up_proj (2 KV heads: one each)."""
    check_against_hf(
        *phi3_long,
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


def test_phi3_is_registered_and_traced_as_llama(phi3_short: tuple[str, Any]) -> None:
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
    with LLM(model=phi3_short[0], enable_multiprocessing=False, trace_detail="full") as llm:
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


@contextmanager
def _engine_max_model_len(hf_config: Any, max_model_len: int) -> Iterator[None]:
    """A real VllmConfig with this max_model_len made current, as the model
    loader makes the engine's while it builds the model."""
    from tracevllm.config import (
        CacheConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )

    config_dict = hf_config.to_dict() | {"architectures": ["Phi3ForCausalLM"]}
    model_config = ModelConfig(model="unused", hf_config=config_dict, max_model_len=max_model_len)
    vllm_config = VllmConfig(
        model_config=model_config, cache_config=CacheConfig(), scheduler_config=SchedulerConfig()
    )
    with set_current_vllm_config(vllm_config):
        yield


@pytest.mark.parametrize(
    ("partial_rotary_factor", "extra"),
    [(1.0, {}), (0.5, {}), (1.0, {"attention_factor": 1.7}), (1.0, {"factor": 4.0})],
)
@pytest.mark.parametrize("use_long_rope", [False, True])
def test_longrope_equals_hf_rotary_embedding(
    partial_rotary_factor: float, extra: dict[str, Any], use_long_rope: bool
) -> None:
    """max_model_len <= original: our short factors equal HF's on a call within
    the original length. max_model_len > original: our long factors equal
    HF's on a call past it, for every position of it, those below the
    original length included. Attention factor and partial rotary dims too."""
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
    max_model_len = 3 * ORIGINAL_MAX if use_long_rope else ORIGINAL_MAX
    with _engine_max_model_len(config, max_model_len):
        rope = get_rope(HEAD_DIM, config.max_position_embeddings, True, config.rope_parameters)
    assert isinstance(rope, Phi3LongRoPEScaledRotaryEmbedding)
    assert rope.rotary_dim == rotary_dim
    assert rope.use_long_rope is use_long_rope
    gen = torch.Generator().manual_seed(0)
    # One HF call over all of them: its largest position + 1 decides HF's set.
    in_order = torch.arange(max_model_len)
    for positions in (in_order, in_order[torch.randperm(max_model_len, generator=gen)]):
        q = torch.randn(len(positions), 4 * HEAD_DIM, generator=gen)
        k = torch.randn(len(positions), 2 * HEAD_DIM, generator=gen)
        ours = rope(positions, q, k)
        theirs = _hf_rotate(config, positions, q, k)
        torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=1e-6)
        if rotary_dim < HEAD_DIM:  # the rest of each head passes through
            tail = q.view(len(positions), 4, HEAD_DIM)[..., rotary_dim:]
            assert torch.equal(ours[0].view(len(positions), 4, HEAD_DIM)[..., rotary_dim:], tail)


def test_longrope_attention_factor_and_table() -> None:
    """sqrt(1 + ln(512 / 48) / ln(48)) on cos/sin. One table: 48 short rows,
    then 512 long ones; with no engine config current, max_model_len is the
    model's max_position_embeddings (512 > 48: long, position p at row 48 + p)."""
    from tracevllm.model_executor.layers.rotary_embedding import get_rope

    params = longrope_parameters(original_max_position_embeddings=ORIGINAL_MAX)
    rope = get_rope(HEAD_DIM, 512, True, params)
    expected = math.sqrt(1 + math.log(512 / ORIGINAL_MAX) / math.log(ORIGINAL_MAX))
    assert rope.short_mscale == pytest.approx(expected)  # type: ignore[union-attr]
    assert rope.use_long_rope  # type: ignore[union-attr]
    cache = rope.long_short_cos_sin_cache  # type: ignore[union-attr]
    assert cache.shape == (ORIGINAL_MAX + 512, HEAD_DIM)
    # Position 0 of either set: cos = mscale, sin = 0 whatever the factors.
    for row in (0, ORIGINAL_MAX):
        torch.testing.assert_close(
            cache[row, : HEAD_DIM // 2], torch.full((HEAD_DIM // 2,), expected)
        )
    # The lowest frequency (last factor) at position p: p / (factor * base ** (14 / 16)).
    for row, p, factor in ((ORIGINAL_MAX - 1, ORIGINAL_MAX - 1, params["short_factor"][-1]),
                           (ORIGINAL_MAX + 5, 5, params["long_factor"][-1])):  # fmt: skip
        angle = p / (factor * 10000.0 ** (14 / 16))
        assert cache[row, HEAD_DIM // 2 - 1].item() == pytest.approx(
            math.cos(angle) * expected, rel=1e-5
        )
    # Within the original length, no engine config: the short set.
    short_rope = get_rope(HEAD_DIM, ORIGINAL_MAX, True, params)
    assert not short_rope.use_long_rope  # type: ignore[union-attr]


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


def test_get_rope_builds_one_module_per_distinct_rope() -> None:
    """vLLM's _ROPE_DICT: every layer asking for the same RoPE shares one
    module (one cos/sin table); a different theta, length or LongRoPE
    max_model_len gets its own."""
    from transformers import Phi3Config

    from tracevllm.model_executor.layers.rotary_embedding import get_rope

    plain = {"rope_type": "default", "rope_theta": 10000.0}
    first = get_rope(HEAD_DIM, 512, True, dict(plain))
    assert get_rope(HEAD_DIM, 512, True, dict(plain)) is first
    assert get_rope(HEAD_DIM, 512, True, plain | {"rope_theta": 500000.0}) is not first
    assert get_rope(HEAD_DIM, 256, True, dict(plain)) is not first
    config = Phi3Config(
        **tiny_config_kwargs(
            64,
            original_max_position_embeddings=ORIGINAL_MAX,
            rope_parameters=longrope_parameters(HEAD_DIM),
        )
    )
    with _engine_max_model_len(config, ORIGINAL_MAX):
        short = get_rope(HEAD_DIM, 512, True, config.rope_parameters)
    with _engine_max_model_len(config, 3 * ORIGINAL_MAX):
        long = get_rope(HEAD_DIM, 512, True, config.rope_parameters)
    assert not short.use_long_rope and long.use_long_rope  # type: ignore[union-attr]
