"""The family check (tests/family_check.py) on Llama itself, the family every
other is described against: HF's LlamaForCausalLM, written by HF."""

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


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-llama-family")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(vocab_size)))
    save_hf_model(model, path)
    return path, model


@pytest.mark.parametrize("enable_multiprocessing", [False, True])
def test_llama_matches_hf(llama: tuple[str, Any], enable_multiprocessing: bool) -> None:
    check_against_hf(*llama, enable_multiprocessing=enable_multiprocessing)
