"""Gemma-2 against HF transformers' own Gemma2ForCausalLM (tests/family_check.py).

The tiny checkpoint is made so that each thing Gemma-2 changes relative to
Llama shows in the tokens or the log-probabilities:

- 4 layers, sliding on 0 and 2 and full on 1 and 3 (HF's default
  ``layer_types``), with a window of 12 tokens, shorter than most prompts:
  two KV cache groups, and the sliding group's blocks freed as a request
  decodes (bounded as tests/test_sliding_window.py bounds them);
- ``initializer_range`` 0.2, so attention scores reach about 20 and raw logits
  about 10: both soft caps (5.0 in attention, 3.0 on the logits) change them;
- ``head_dim`` 32 with 4 heads of a 64-wide model (not 64 / 4), and
  ``query_pre_attn_scalar`` 24 (not head_dim): the config's values are the
  ones used;
- the norms' weights drawn at random (HF starts them at zero, where
  ``x * (1 + w)`` and ``x`` agree).

HF runs with ``attn_implementation="eager"``: its sdpa path ignores the
attention soft cap.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tests.family_check as family_check
from tests.family_check import (
    BLOCK_SIZE,
    NUM_TOKENS,
    check_against_hf,
    hf_greedy,
    make_prompts,
    new_checkpoint_dir,
    save_hf_model,
    tiny_config_kwargs,
)
from tests.test_sliding_window import WINDOW, WindowBound, with_window_bound
from tracevllm import LLM, SamplingParams
from tracevllm.utils.math_utils import cdiv

SLIDING = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
FULL = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]


def gemma2_config_kwargs(vocab_size: int) -> dict[str, Any]:
    return tiny_config_kwargs(
        vocab_size,
        num_hidden_layers=4,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        initializer_range=0.2,
    )


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-gemma2-family")
    torch.manual_seed(0)
    config = Gemma2Config(**gemma2_config_kwargs(vocab_size), attn_implementation="eager")
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    save_hf_model(model, path)
    return path, model


@pytest.fixture(scope="module", autouse=True)
def _hf_greedy_once(gemma2: tuple[str, Any]) -> Iterator[None]:
    """HF's eager Gemma-2 takes ~0.1 s a token here: each prompt's reference is
    computed once for the module, not once per test (it is deterministic)."""
    cache: dict[tuple[int, tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    def cached(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        key = (id(model), tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(model, prompt, n)
        return cache[key]

    patch = pytest.MonkeyPatch()
    patch.setattr(family_check, "hf_greedy", cached)
    yield
    patch.undo()


def test_gemma2_matches_hf_in_process(
    gemma2: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two KV cache groups (sliding, full) from one pool, each layer reading its
    own; no decoding request holds more than cdiv(W, bs) + 1 sliding blocks."""
    assert BLOCK_SIZE == 4
    bounds: list[WindowBound] = []
    monkeypatch.setattr(family_check, "LLM", with_window_bound(bounds))
    check_against_hf(*gemma2, enable_multiprocessing=False)
    (bound,) = bounds
    assert bound.decode_steps > 0
    assert bound.max_held == cdiv(WINDOW, BLOCK_SIZE) + 1  # the bound is reached, not loose
    groups = bound.mgr.kv_cache_config.kv_cache_groups
    kinds = {type(g.kv_cache_spec).__name__: g.layer_names for g in groups}
    assert kinds == {"SlidingWindowSpec": SLIDING, "FullAttentionSpec": FULL}
    assert type(bound.mgr.coordinator).__name__ == "HybridKVCacheCoordinator"
    freed = [
        getattr(m, "num_skipped_blocks_freed", 0)
        for m in bound.mgr.coordinator.single_type_managers
    ]
    assert freed[0] > 0


def test_gemma2_matches_hf_in_a_separate_engine_process(gemma2: tuple[str, Any]) -> None:
    check_against_hf(*gemma2, enable_multiprocessing=True)


@pytest.mark.parametrize(
    "parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"]
)
def test_gemma2_on_two_ranks_matches_hf(gemma2: tuple[str, Any], parallel: dict[str, int]) -> None:
    """Two ranks over the mp executor. TP: heads, MLP and vocabulary split in
    two. PP: a sliding and a full layer on each stage, the embedding on both
    (the last reads it as the LM head)."""
    path, model = gemma2
    prompts = [make_prompts(model.config.vocab_size)[i] for i in (2, 4)]  # 13 and 41 tokens
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(
        model=path,
        block_size=BLOCK_SIZE,
        max_model_len=128,
        distributed_executor_backend="mp",
        **parallel,
    )
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = family_check.hf_greedy(model, prompt, NUM_TOKENS)[0][:16]
        assert list(output.outputs[0].token_ids) == tokens, f"prompt of {len(prompt)} tokens"


def test_gemma2_without_layer_types_keeps_its_full_layers_full(
    gemma2: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Gemma-2 config.json files written before transformers had ``layer_types``
    (Google's among them) name only ``sliding_window``; Gemma2Config alternates
    the layers when it reads them. The window must not become the model-wide
    ``cache_config.sliding_window``, which would make the full layers slide too."""
    import json
    import os
    import shutil

    from tracevllm.engine.arg_utils import EngineArgs

    path, model = gemma2
    old = str(tmp_path_factory.mktemp("tiny-gemma2-no-layer-types"))
    shutil.copytree(path, old, dirs_exist_ok=True)
    with open(os.path.join(old, "config.json")) as f:
        config = json.load(f)
    del config["layer_types"]
    with open(os.path.join(old, "config.json"), "w") as f:
        json.dump(config, f)
    assert EngineArgs(model=old).create_engine_config().cache_config.sliding_window is None
    prompt = make_prompts(model.config.vocab_size)[4]  # 41 tokens, past the window
    llm = LLM(model=old, block_size=BLOCK_SIZE, max_model_len=128, enable_multiprocessing=False)
    try:
        (output,) = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    tokens, logprobs = (x[:8] for x in family_check.hf_greedy(model, prompt, NUM_TOKENS))
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    assert completion.logprobs is not None
    ours = [lp[t].logprob for lp, t in zip(completion.logprobs, tokens, strict=True)]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_gemma2_spans_are_llamas_and_the_kv_view_shows_the_freed_blocks(
    gemma2: tuple[str, Any],
) -> None:
    """At detail ``full``: the forward's spans nest as llama.py's (named after
    this model's classes), each layer's attention span carries its window and
    soft cap, and the step view gives the sliding group's freed blocks."""
    import json

    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracevllm.tracing.attributes import SpanAttributes
    from tracevllm.views.report import STEP_SPAN

    path, model = gemma2
    prompts = make_prompts(model.config.vocab_size)[3:5]  # 30 and 41 tokens
    exporter = InMemorySpanExporter()
    llm = LLM(
        model=path,
        block_size=BLOCK_SIZE,
        max_model_len=128,
        enable_multiprocessing=False,
        trace_detail="full",
    )
    try:
        provider = llm.llm_engine.tracer_provider
        assert provider is not None
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    spans = list(exporter.get_finished_spans())
    by_id = {s.context.span_id: s for s in spans}

    def parent(span: Any) -> Any:
        return by_id.get(span.parent.span_id) if span.parent else None

    forwards = [s for s in spans if s.name == "Gemma2ForCausalLM.forward"]
    assert forwards and all(parent(f).name == "ModelRunner.execute_model" for f in forwards)
    assert not any(s.name.startswith("Llama") for s in spans)
    layers = [s for s in spans if s.name == "Gemma2DecoderLayer.forward"]
    assert {parent(s).name for s in layers} == {"Gemma2ForCausalLM.forward"}
    assert len(layers) == 4 * len(forwards)
    assert layers[0].attributes["code.function.name"] == "Gemma2DecoderLayer.forward"
    for name in ("reshape_and_cache_flash", "unified_attention"):
        inside = [s for s in spans if s.name == name]
        assert {parent(s).name for s in inside} == {"Gemma2DecoderLayer.forward"}
    for read in (s for s in spans if s.name == "unified_attention"):
        layer = read.attributes["tracevllm.layer"]
        assert read.attributes["tracevllm.attention.logits_soft_cap"] == 5.0
        window = read.attributes.get("tracevllm.attention.sliding_window")
        assert window == (WINDOW if layer % 2 == 0 else None), layer
    views = [
        json.loads(str(s.attributes[SpanAttributes.STEP_VIEW]))
        for s in spans
        if s.name == STEP_SPAN and SpanAttributes.STEP_VIEW in s.attributes
    ]
    groups = views[-1]["kv"]["groups"]
    assert [(g["kind"], g["sliding_window"]) for g in groups] == [
        ("SlidingWindowSpec", WINDOW),
        ("FullAttentionSpec", None),
    ]
    assert groups[0]["freed_by_window"] > 0 and groups[1]["freed_by_window"] == 0


# --- the layers Gemma-2 adds, against HF's own --------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_is_hfs(dtype: torch.dtype) -> None:
    """``x * (1 + w)`` with the product in fp32 (bf16 shows the order), and the
    residual form returning the sum."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from tracevllm.model_executor.layers.layernorm import GemmaRMSNorm

    torch.manual_seed(0)
    hf, ours = Gemma2RMSNorm(64, eps=1e-6).to(dtype), GemmaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.5)
        ours.weight.copy_(hf.weight)
    x, residual = (torch.randn(5, 64) * 3).to(dtype), torch.randn(5, 64).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x))
        out, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(out, hf(x + residual))


def test_gelu_and_mul_is_hfs_gelu_pytorch_tanh() -> None:
    from transformers.activations import ACT2FN

    from tracevllm.model_executor.layers.activation import GeluAndMul

    x = torch.linspace(-6, 6, 2 * 500).reshape(2, 500)
    expected = ACT2FN["gelu_pytorch_tanh"](x[:, :250]) * x[:, 250:]
    torch.testing.assert_close(GeluAndMul(approximate="tanh")(x), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="Unknown approximate mode: fast"):
        GeluAndMul(approximate="fast")


def test_the_embedding_scale_is_rounded_to_the_models_dtype() -> None:
    """sqrt(72) = 8.485 is 8.5 in bf16: HF multiplies by the rounded constant, so must we."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.parallel_utils import init_world_of_one
    from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from tracevllm.model_executor.model_loader import initialize_model

    init_world_of_one()
    config = Gemma2Config(
        **gemma2_config_kwargs(100) | dict(hidden_size=72, num_hidden_layers=2),
        architectures=["Gemma2ForCausalLM"],
    )
    torch.manual_seed(0)
    hf = Gemma2ForCausalLM(config).to(torch.bfloat16)
    model_config = ModelConfig(model="unused", hf_config=config, dtype="bfloat16")
    ours = initialize_model(VllmConfig(model_config, CacheConfig(), SchedulerConfig()))
    with torch.no_grad():
        ours.model.embed_tokens.weight[:100].copy_(hf.model.embed_tokens.weight)  # padded to 128
        ids = torch.arange(3, 100)
        assert torch.equal(ours.embed_input_ids(ids), hf.model.embed_tokens(ids))
