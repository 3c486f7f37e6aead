"""Where a compiled model is kept on disk, and what decides it.

Mirrors the hashing in vllm/compilation/backends.py (``VllmBackend.__call__``:
``torch_compile_cache/<hash>/rank_i_j/<prefix>``) and vllm/compilation/caching.py
(``_compute_code_hash``). The hash covers what changes the compiled code:

- the configs the graph depends on (vLLM's ``vllm_config.compute_hash()``):
  the model (its path, dtype, ``max_model_len``, the HF config), the KV
  block size, tensor and pipeline parallel sizes, and the compilation
  config (mode, backend, splitting ops, compile sizes, Inductor options);
- the compiler (torch's version, Inductor's config);
- the source of every file Dynamo traced through (edit llama.py and the
  next start compiles again).

The weights are not in it: Dynamo lifts parameters to graph inputs, so the
same compiled pieces run any checkpoint of the same architecture and shape.
Left out: vLLM's environment-variable factors and the AOT-compile hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tracevllm import envs

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig


def config_hash_factors(vllm_config: VllmConfig) -> dict[str, Any]:
    """The configs' part of the key (vLLM's ``VllmConfig.compute_hash``)."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return {
        "model": os.path.realpath(model_config.model),
        "dtype": model_config.torch_dtype,
        "max_model_len": model_config.max_model_len,
        "hf_config": json.dumps(model_config.hf_config_dict, sort_keys=True, default=str),
        "block_size": vllm_config.cache_config.block_size,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "compilation": vllm_config.compilation_config.compute_hash(),
    }


def compute_code_hash(files: Iterable[str]) -> str:
    """sha256 over each traced file's path and content (vLLM's ``_compute_code_hash``)."""
    content: list[str] = []
    for path in sorted(set(files)):
        if path == "<string>" or not os.path.isfile(path):
            continue  # code made by exec(): nothing to read
        content.append(path)
        with open(path, encoding="utf-8", errors="replace") as f:
            content.append(f.read())
    return hashlib.sha256("\n".join(content).encode()).hexdigest()


def compute_cache_hash(vllm_config: VllmConfig, compiler_hash: str, code_hash: str) -> str:
    factors = [config_hash_factors(vllm_config), compiler_hash, code_hash]
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:10]


def local_cache_dir(vllm_config: VllmConfig, hash_key: str, prefix: str) -> str:
    """``<cache_dir or $TRACEVLLM_CACHE_DIR/torch_compile_cache/hash>/rank_i_j/prefix``."""
    compilation_config = vllm_config.compilation_config
    if not compilation_config.cache_dir:
        compilation_config.cache_dir = os.path.join(
            envs.TRACEVLLM_CACHE_DIR, "torch_compile_cache", hash_key
        )
    parallel = vllm_config.parallel_config
    rank_dir = f"rank_{parallel.rank}_{parallel.data_parallel_rank}"
    return os.path.join(compilation_config.cache_dir, rank_dir, prefix)
