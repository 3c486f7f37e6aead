"""Mistral against HF transformers' own MistralForCausalLM (tests/family_check.py).

vLLM's registry (and tracevllm's) runs ``MistralForCausalLM`` as a Llama;
what Mistral adds is ``sliding_window``, here 12 tokens, shorter than most of
the family check's prompts (up to 41 tokens, 73 with their 32 generated), so
a window applied wrongly (or not at all) shows in the tokens. Every layer
slides: the window is the model-wide ``cache_config.sliding_window`` and the
KV cache is one ``SlidingWindowSpec`` group. In-process the block bound of
tests/test_sliding_window.py is checked after every step as well.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tests.family_check as family_check
from tests.family_check import (
    BLOCK_SIZE,
    check_against_hf,
    new_checkpoint_dir,
    save_hf_model,
    tiny_config_kwargs,
)
from tests.test_sliding_window import WINDOW, WindowBound, with_window_bound
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.utils.math_utils import cdiv


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from transformers import MistralConfig, MistralForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-mistral-family")
    torch.manual_seed(0)
    config = MistralConfig(**tiny_config_kwargs(vocab_size, sliding_window=WINDOW))
    assert config.sliding_window == WINDOW < max(family_check.PROMPT_LENS)
    model = MistralForCausalLM(config).eval()
    save_hf_model(model, path)
    return path, model


def test_mistral_window_is_model_wide(mistral: tuple[str, Any]) -> None:
    config = EngineArgs(model=mistral[0]).create_engine_config()
    assert config.model_config.architecture == "MistralForCausalLM"
    assert config.cache_config.sliding_window == WINDOW


@pytest.mark.parametrize("enable_multiprocessing", [False, True])
def test_mistral_matches_hf(
    mistral: tuple[str, Any], enable_multiprocessing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    bounds: list[WindowBound] = []
    if not enable_multiprocessing:  # the engine core is in this process: watch its KV manager
        monkeypatch.setattr(family_check, "LLM", with_window_bound(bounds))
    # A window needs few blocks: a pool of 12 still preempts 8 requests (40
    # does not), and full attention would need 32 for one 128-token request.
    check_against_hf(
        *mistral, enable_multiprocessing=enable_multiprocessing, num_gpu_blocks_override=12
    )
    if bounds:
        (bound,) = bounds
        assert bound.decode_steps > 0
        assert bound.max_held == cdiv(WINDOW, BLOCK_SIZE) + 1  # reached, not loose
        groups = bound.mgr.kv_cache_config.kv_cache_groups
        assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec"]
        assert bound.mgr.coordinator.single_type_managers[0].num_skipped_blocks_freed > 0
