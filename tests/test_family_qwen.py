"""Qwen2 and Qwen3 against HF transformers' own Qwen2ForCausalLM and
Qwen3ForCausalLM (tests/family_check.py).

Each tiny checkpoint is made so that what the family changes relative to
Llama shows in the tokens or the log-probabilities:

- Qwen2: the q/k/v biases drawn at random (HF starts them at zero, where a
  model without them would agree);
- Qwen2 with ``use_sliding_window`` and ``max_window_layers`` 1: layer 0 full,
  layer 1 sliding over 12 tokens (HF's ``layer_types``), so two KV cache
  groups and a block bound as tests/test_sliding_window.py checks it;
- Qwen2 as older checkpoints write it, without ``layer_types``: 4 layers,
  ``max_window_layers`` 2, so HF's config class makes layers 0-1 full and
  2-3 sliding; and a Qwen2 whose config.json names a small ``sliding_window``
  that ``use_sliding_window`` false (or absent: HF's default) turns off;
- Qwen3: ``head_dim`` 32 with 4 heads of a 64-wide model (not 64 / 4), the
  q_norm/k_norm weights drawn at random (HF starts them at one), tied embeddings.

Both also run on two tensor-parallel ranks (the mp executor), and their spans
are named after their own classes.
"""

from __future__ import annotations

import json
import os
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
from tests.test_sliding_window import WINDOW, WindowBound, with_window_bound
from tracevllm import LLM, SamplingParams
from tracevllm.engine.arg_utils import EngineArgs
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


def _rewrite_config_json(path: str, drop: tuple[str, ...] = (), **values: Any) -> None:
    """Edit the saved config.json as an older (or hand-written) checkpoint has it."""
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    for key in drop:
        del config[key]
    config.update(values)
    with open(config_path, "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def qwen2_sliding_no_layer_types(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """4 layers, ``max_window_layers`` 2, config.json without ``layer_types``."""
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-qwen2-no-layer-types")
    torch.manual_seed(2)
    config = Qwen2Config(
        **tiny_config_kwargs(vocab_size, num_hidden_layers=4),
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,
    )
    model = Qwen2ForCausalLM(config).eval()
    _randomize(model, (".q_proj.bias", ".k_proj.bias", ".v_proj.bias"), mean=0.0)
    save_hf_model(model, path)
    _rewrite_config_json(path, drop=("layer_types",))
    # HF fills the kinds back in as it reads the file.
    kinds = ["full_attention"] * 2 + ["sliding_attention"] * 2
    assert AutoConfig.from_pretrained(path).layer_types == kinds == model.config.layer_types
    return path, model


@pytest.fixture(scope="module", params=["false", "absent"])
def qwen2_window_off(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any]:
    """A Qwen2 whose config.json carries ``sliding_window`` = WINDOW (as real
    Qwen2 checkpoints carry 4096 or more) with ``use_sliding_window`` false or
    absent (HF's default: false), and no ``layer_types``: no layer slides."""
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, f"tiny-qwen2-window-{request.param}")
    torch.manual_seed(3)
    config = Qwen2Config(
        **tiny_config_kwargs(vocab_size), use_sliding_window=False, max_window_layers=0
    )
    assert config.sliding_window is None
    model = Qwen2ForCausalLM(config).eval()
    _randomize(model, (".q_proj.bias", ".k_proj.bias", ".v_proj.bias"), mean=0.0)
    save_hf_model(model, path)
    drop = ("layer_types",) + (("use_sliding_window",) if request.param == "absent" else ())
    _rewrite_config_json(path, drop=drop, sliding_window=WINDOW)
    read = AutoConfig.from_pretrained(path)
    assert read.sliding_window is None and read.layer_types == ["full_attention"] * 2
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


def test_qwen2_sliding_window_matches_hf(
    qwen2_sliding: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF's layer_types from use_sliding_window/max_window_layers: a full and a
    sliding KV cache group, the sliding one bounded to cdiv(W, bs) + 1 blocks."""
    bounds: list[WindowBound] = []
    monkeypatch.setattr(family_check, "LLM", with_window_bound(bounds))
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


def test_qwen2_without_layer_types_slides_only_hf_s_sliding_layers(
    qwen2_sliding_no_layer_types: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``layer_types`` in config.json the kinds come from
    ``use_sliding_window`` and ``max_window_layers`` as Qwen2Config derives
    them: the window is no model-wide ``cache_config.sliding_window`` (which
    would make the two full layers slide too), only the last two layers'."""
    path = qwen2_sliding_no_layer_types[0]
    assert EngineArgs(model=path).create_engine_config().cache_config.sliding_window is None
    bounds: list[WindowBound] = []
    monkeypatch.setattr(family_check, "LLM", with_window_bound(bounds))
    check_against_hf(*qwen2_sliding_no_layer_types, enable_multiprocessing=False)
    (bound,) = bounds
    assert bound.decode_steps > 0 and bound.max_held == cdiv(WINDOW, BLOCK_SIZE) + 1
    groups = bound.mgr.kv_cache_config.kv_cache_groups
    kinds = {type(g.kv_cache_spec).__name__: g.layer_names for g in groups}
    assert kinds == {
        "FullAttentionSpec": ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
        "SlidingWindowSpec": ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"],
    }


def test_qwen2_with_use_sliding_window_off_has_no_window(
    qwen2_window_off: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sliding_window`` in config.json is not a window unless
    ``use_sliding_window`` is true (Qwen2Config clears it): every layer full."""
    path = qwen2_window_off[0]
    assert EngineArgs(model=path).create_engine_config().cache_config.sliding_window is None
    bounds: list[WindowBound] = []
    monkeypatch.setattr(family_check, "LLM", with_window_bound(bounds))
    check_against_hf(*qwen2_window_off, enable_multiprocessing=False)
    groups = bounds[0].mgr.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["FullAttentionSpec"]


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


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"])
def test_a_config_json_missing_a_field_names_its_architecture(arch: str, tmp_path: Any) -> None:
    """The error for a config.json without a required field names the
    architecture config.json gives, not Llama's, and says what to do."""
    from tracevllm.config import ModelConfig

    config = {"architectures": [arch], "hidden_size": 64, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_attention_heads": 4}))
    with pytest.raises(ValueError) as info:
        ModelConfig(model=str(tmp_path))
    message = str(info.value)
    assert f"has no 'vocab_size', which a {arch} config.json must have: add it" in message
    assert "Llama" not in message


@pytest.mark.parametrize(
    ("model_type", "arch", "flag", "window"),
    [
        ("qwen2", "Qwen2ForCausalLM", None, None),
        ("qwen3", "Qwen3ForCausalLM", None, None),
        ("qwen3_moe", "Qwen3MoeForCausalLM", None, None),
        ("qwen3_moe", "Qwen3MoeForCausalLM", False, None),
        ("qwen3_moe", "Qwen3MoeForCausalLM", True, WINDOW),
        ("mistral", "MistralForCausalLM", None, WINDOW),
    ],
)
def test_the_model_wide_window_follows_use_sliding_window(
    model_type: str, arch: str, flag: bool | None, window: int | None, tmp_path: Any
) -> None:
    """Qwen's config classes default ``use_sliding_window`` to false and then
    clear ``sliding_window``; Mistral's has no flag: its window always holds.
    (Qwen3-MoE's class lists no layer_types: its window is all layers' or none.)"""
    from tracevllm.config import ModelConfig
    from tracevllm.engine.arg_utils import model_wide_sliding_window

    config: dict[str, Any] = tiny_config_kwargs(100, sliding_window=WINDOW)
    config |= {"architectures": [arch], "model_type": model_type}
    if flag is not None:
        config["use_sliding_window"] = flag
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(model=str(tmp_path))
    assert model_config.get_sliding_window() == window
    assert model_wide_sliding_window(model_config) == window
