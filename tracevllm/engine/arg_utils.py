"""``EngineArgs``: every engine knob in one flat dataclass, turned into ``VllmConfig``.

Mirrors vllm/engine/arg_utils.py (``EngineArgs``, ``create_engine_config``,
``add_cli_args``). Only the knobs tracevllm has; the defaults are vLLM's for
the offline ``LLM`` class on CPU (max_num_batched_tokens 4096, max_num_seqs 256).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, fields
from typing import Any

from tracevllm.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TraceConfig,
    VllmConfig,
)


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_logprobs: int = 20
    generation_config: str = "auto"
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    # vLLM's ParallelConfig fields (CLI: -tp, -pp, -dp as vLLM's short forms).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # "uni" | "mp" | "ray" (None: "uni" for one worker, else "mp").
    distributed_executor_backend: str | None = None
    device: str = "cpu"
    otlp_traces_endpoint: str | None = None
    trace_detail: str = "off"
    trace_dir: str | None = None
    trace_live_views: bool = False
    # None: TRACEVLLM_ENABLE_MULTIPROCESSING decides (read by LLMEngine).
    enable_multiprocessing: bool | None = None
    # {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}
    speculative_config: dict[str, Any] | None = None

    def create_engine_config(self) -> VllmConfig:
        # Lazy: the loader pulls in torch/transformers only when a model must be
        # converted; resolving a ready directory is cheap.
        from tracevllm.model_executor.model_loader import check_tokenizer_dir, resolve_model

        model_dir = resolve_model(self.model)
        model_config = ModelConfig(
            model=model_dir,
            tokenizer=os.path.abspath(os.path.expanduser(self.tokenizer or model_dir)),
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            max_logprobs=self.max_logprobs,
            generation_config=self.generation_config,
        )
        # Checked now, before the engine process loads any weight.
        assert model_config.tokenizer is not None
        check_tokenizer_dir(model_config.tokenizer)
        max_model_len = model_config.get_max_model_len()
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            # Without chunking a whole prompt must fit in one step.
            max_num_batched_tokens = (
                4096 if self.enable_chunked_prefill else max(4096, max_model_len)
            )
        return VllmConfig(
            speculative_config=self.create_speculative_config(model_config),
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                # Only a model whose every layer slides (Mistral): with
                # alternating layers (Gemma-2) it would override the global ones.
                sliding_window=(
                    None
                    if is_interleaved(model_config.hf_config_dict)
                    else model_config.get_sliding_window()
                ),
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                data_parallel_size=self.data_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            device_config=DeviceConfig(device=self.device),
            attention_config=AttentionConfig(backend=self.attention_backend),
            observability_config=ObservabilityConfig(
                otlp_traces_endpoint=self.otlp_traces_endpoint
            ),
            trace_config=TraceConfig(
                detail=self.trace_detail,
                out_dir=self.trace_dir,
                live_views=self.trace_live_views,
            ),
        )

    def create_speculative_config(self, target: ModelConfig) -> SpeculativeConfig | None:
        """vLLM's ``create_speculative_config``; a draft model's path is resolved
        as the target's is (a directory, a .gguf file)."""
        if self.speculative_config is None:
            return None
        config = self.speculative_config
        model = config.get("model") if isinstance(config, dict) else None
        if isinstance(model, str) and model != "ngram":
            from tracevllm.model_executor.model_loader import resolve_model

            config = {**config, "model": resolve_model(model)}
        return SpeculativeConfig.from_dict(config, target)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One ``--flag`` per field, vLLM's spelling (``--max-num-seqs``)."""
        for f in fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if f.name in _SHORT_FLAGS:
                parser.add_argument(flag, _SHORT_FLAGS[f.name], type=int, default=default)
            elif f.name == "distributed_executor_backend":
                parser.add_argument(flag, choices=DISTRIBUTED_EXECUTOR_BACKENDS, default=None)
            elif f.name == "enable_multiprocessing":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
            elif f.name == "speculative_config":
                # A JSON object, as vLLM's --speculative-config.
                parser.add_argument(flag, type=_json_object, default=None, metavar="JSON")
            elif isinstance(default, bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            elif isinstance(default, int) or f.name.startswith(("max_", "num_")):
                parser.add_argument(flag, type=int, default=default)
            else:
                parser.add_argument(flag, type=str, default=default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


# vLLM's short forms of the parallel sizes.
_SHORT_FLAGS = {
    "tensor_parallel_size": "-tp",
    "pipeline_parallel_size": "-pp",
    "data_parallel_size": "-dp",
}


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def is_interleaved(hf_config: Any) -> bool:
    """Whether the model mixes kinds of attention layer (vLLM: transformers_utils/config.py)."""
    if isinstance(hf_config, dict):
        layer_types = hf_config.get("layer_types")
        if layer_types is None and hf_config.get("model_type") == "gemma2":
            # Gemma-2 checkpoints older than layer_types (Google's among them):
            # Gemma2Config alternates sliding and full layers when it reads
            # them, which is what vLLM's check (on the config class) sees.
            return int(hf_config.get("num_hidden_layers", 0)) > 1
    else:
        layer_types = getattr(hf_config, "layer_types", None)
    return bool(layer_types) and len(set(layer_types or ())) > 1
