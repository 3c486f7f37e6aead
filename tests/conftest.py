"""Shared fixtures: the real default model (converted once) and a tiny random Llama."""

from __future__ import annotations

import os
from typing import Any

import pytest

# Tests compare greedy tokens across engines bit for bit: a thread count that
# changes with the machine's load (the adaptive default) would change the
# matmuls' summation order between runs. tests/test_cpu_threads.py turns it
# on where it is the subject.
os.environ.setdefault("TRACEVLLM_CPU_ADAPTIVE_THREADS", "0")
# Records propagate to the root logger, where caplog reads them (the
# "tracevllm" logger's own handler is tested in tests/test_logger.py).
os.environ.setdefault("TRACEVLLM_CONFIGURE_LOGGING", "0")


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The default model's HF directory (SmolLM2-135M-Instruct), converted once."""
    from tracevllm.model_executor.model_loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """A tiny random-weight Llama (seeded) with the default model's tokenizer."""
    from tests.utils import make_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama")
    return make_tiny_llama(str(path), seed=0, tokenizer_from=default_model_dir)
