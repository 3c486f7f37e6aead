"""Triton is imported only when a Triton path runs (kernels/triton_utils.py).

The torch backend reaches the same kernel files as the Triton backend, for
their ``*_torch`` references; importing Triton there cost a plain in-process
script about fifty lines of ``nanobind: leaked ... functions`` at its exit.
Each check runs in a fresh interpreter: what a process has imported is the
point, and this one has imported Triton already.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernels.triton_utils import HAS_TRITON

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(
    code: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


# A user's plain script: in-process engine, default (CPU_ATTN) backend on CPU.
INPROCESS = """
import sys
from tracevllm import LLM, SamplingParams
from kernels import reshape_and_cache_flash, triton_utils, unified_attention

llm = LLM(model=sys.argv[1])
out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                   use_tqdm=False)
runner = llm.llm_engine.engine_core.engine_core.model_executor.model_runner
from kernels.cpu_attn import cpu_kernels_available
assert runner.attn_backend.get_name() == ("CPU_ATTN" if cpu_kernels_available() else "TORCH_ATTN")
print("TOKENS", len(out[0].outputs[0].token_ids))
# tracevllm never loaded Triton: every kernel is still waiting for a first launch.
print("LOADED", triton_utils._loaded is not None)
kernels = [reshape_and_cache_flash.reshape_and_cache_kernel_flash,
           unified_attention.kernel_unified_attention, unified_attention.reduce_segments]
print("DEFERRED", all(isinstance(k, triton_utils._DeferredKernel) for k in kernels))
"""


def test_inprocess_generate_loads_no_triton_and_prints_no_leaks(tiny_model_dir: str) -> None:
    """A CPU-backend generate in the caller's process leaves tracevllm's
    kernels unjitted, and the process exits without a word from nanobind.

    (``triton`` itself may still be in ``sys.modules``: transformers'
    AutoConfig imports ``torch._dynamo``, which imports it when installed.
    Imported and never used, it leaks nothing.)"""
    result = _python(INPROCESS, tiny_model_dir, env={"TRACEVLLM_ENABLE_MULTIPROCESSING": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TOKENS 4" in result.stdout
    assert "LOADED False" in result.stdout and "DEFERRED True" in result.stdout
    assert "nanobind" not in result.stdout + result.stderr
    assert "leaked" not in result.stdout + result.stderr


def test_the_torch_references_import_and_run_without_triton() -> None:
    """The door into kernels/ and every kernel file import without Triton;
    the torch backend's ops run; Triton is still not imported after."""
    code = """
import sys
import torch
from tracevllm import _custom_ops as ops
from tracevllm.attention.selector import get_attn_backend
import kernels.flash_attention, kernels.reshape_and_cache_flash, kernels.unified_attention

assert get_attn_backend("torch", "cpu").get_name() == "TORCH_ATTN"
key = torch.randn(3, 2, 8)
cache = torch.zeros(2, 2, 4, 2, 8)
ops.reshape_and_cache_flash(key, key, cache, torch.tensor([0, 5, -1]))
assert torch.equal(cache[1, 0, 1], key[1])
print("TRITON", "triton" in sys.modules)
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TRITON False" in result.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_kernels_wait_for_a_launch_even_when_triton_is_already_imported() -> None:
    """torch's compiler (which transformers imports) may have imported Triton
    first: the kernels are still made only at a first launch, since a
    kernel made and never launched is what leaves nanobind's warnings."""
    code = """
import triton
from kernels import triton_utils, unified_attention
assert isinstance(unified_attention.kernel_unified_attention, triton_utils._DeferredKernel)
assert triton_utils._loaded is None
print("OK")
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_a_deferred_kernel_loads_triton_at_its_first_launch() -> None:
    """Launched, a deferred kernel imports Triton (here its CPU interpreter)
    and runs; after, the kernel module holds the real kernel, ``triton`` and
    ``tl``, where Triton's compiler and interpreter look for them."""
    code = """
import sys
import torch
from kernels import reshape_and_cache_flash as m, triton_utils

assert "triton" not in sys.modules
assert isinstance(m.reshape_and_cache_kernel_flash, triton_utils._DeferredKernel)
key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
slots = torch.tensor([0, 3, 9, -1, 4])
expected, got = torch.zeros(3, 2, 4, 2, 16), torch.zeros(3, 2, 4, 2, 16)
m.reshape_and_cache_flash_torch(key, value, expected, slots)
m.reshape_and_cache_flash_triton(key, value, got, slots)
assert torch.equal(got, expected)

import triton, triton.language
from triton.runtime.interpreter import InterpretedFunction
assert isinstance(m.reshape_and_cache_kernel_flash, InterpretedFunction)
assert m.triton is triton and m.tl is triton.language
assert triton_utils.triton is triton and triton_utils.interpreter_active()
print("OK")
"""
    result = _python(code, env={"TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout
