"""``EngineArgs``: every engine knob in one flat dataclass, turned into ``VllmConfig``.

Mirrors vllm/engine/arg_utils.py (``EngineArgs``, ``create_engine_config``,
``add_cli_args``). Only the knobs tracevllm has; the defaults are vLLM's for
the offline ``LLM`` class on CPU (max_num_batched_tokens 4096, max_num_seqs 256).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from dataclasses import dataclass, fields
from typing import Any

from tracevllm.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_OFFLOADING_BACKENDS,
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    CompilationMode,
    DeviceConfig,
    KVTransferConfig,
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
    # vLLM's KV offloading: a second tier of this many GiB, "native" (the
    # OffloadingConnector's CPU tier); None: off.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    # Schedule step N+1 while the workers run step N (None: off in tracevllm,
    # see SchedulerConfig.async_scheduling).
    async_scheduling: bool | None = None
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
    # {"kv_connector": "ExampleConnector", "kv_role": "kv_producer", ...} (KVTransferConfig)
    kv_transfer_config: dict[str, Any] | KVTransferConfig | None = None
    # vLLM's: True never compiles; None is settled in VllmConfig (compilation/config.py).
    enforce_eager: bool | None = None
    # {"mode": 3, "compile_sizes": [1, 2, 4], ...} (CompilationConfig; CLI -cc JSON)
    compilation_config: dict[str, Any] | CompilationConfig | None = None
    # vLLM's -O0..-O3: 0 compiles nothing, 1-3 compile (mode VLLM_COMPILE)
    # unless compilation_config names a mode.
    optimization_level: int | None = None

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
            enforce_eager=self.enforce_eager,
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
            kv_transfer_config=self.create_kv_transfer_config(),
            compilation_config=self.create_compilation_config(),
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                sliding_window=model_wide_sliding_window(model_config),
                kv_offloading_size=self.kv_offloading_size,
                kv_offloading_backend=self.kv_offloading_backend,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                async_scheduling=self.async_scheduling,
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

    def create_compilation_config(self) -> CompilationConfig:
        """The config from a dict or JSON (a copy of one given), with ``-O`` applied:
        vLLM's level 0 is mode NONE, 1-3 VLLM_COMPILE, where no mode is given."""
        config = CompilationConfig.from_cli(copy.deepcopy(self.compilation_config or {}))
        level = self.optimization_level
        if level is not None:
            if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 3:
                raise ValueError(f"optimization_level must be 0, 1, 2 or 3, got {level!r}.")
            if config.mode is None:
                config.mode = CompilationMode.NONE if level == 0 else CompilationMode.VLLM_COMPILE
        return config

    def create_kv_transfer_config(self) -> KVTransferConfig | None:
        """The config from a dict (or as given); an unknown connector is refused
        here, in the frontend, before an engine process starts (vLLM: when the
        scheduler creates it)."""
        config = self.kv_transfer_config
        if config is None or isinstance(config, KVTransferConfig):
            return config
        kv_transfer_config = KVTransferConfig.from_dict(config)
        # Only the registry's names: importing a connector would import torch.
        from tracevllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        KVConnectorFactory.check_connector_name(kv_transfer_config)
        return kv_transfer_config

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
            elif f.name == "compilation_config":
                parser.add_argument(flag, "-cc", type=_json_object, default=None, metavar="JSON")
            elif f.name == "optimization_level":
                # -O3 and -O 3, as vLLM.
                parser.add_argument(flag, "-O", type=int, choices=range(4), default=None)
            elif f.name == "kv_offloading_size":
                parser.add_argument(flag, type=float, default=None, metavar="GiB")
            elif f.name == "kv_offloading_backend":
                parser.add_argument(flag, choices=KV_OFFLOADING_BACKENDS, default=default)
            elif f.name in ("enable_multiprocessing", "async_scheduling", "enforce_eager"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
            elif f.name in ("speculative_config", "kv_transfer_config"):
                # A JSON object, as vLLM's --speculative-config / --kv-transfer-config.
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
    """Whether the model mixes kinds of attention layer (vLLM: transformers_utils/config.py).

    vLLM asks the transformers config; the frontend holds config.json as a
    dict (no transformers: it imports torch), so for a dict the kinds are
    those the config class would fill in (``hf_layer_types``).
    """
    if isinstance(hf_config, dict):
        layer_types = hf_layer_types(hf_config)
    else:
        layer_types = getattr(hf_config, "layer_types", None)
    return bool(layer_types) and len(set(layer_types or ())) > 1


# Config classes that fill in layer_types from other fields when config.json
# has none, as transformers' configuration_qwen2.py / _qwen3.py / _gemma2.py do.
_QWEN_LAYER_TYPES = ("qwen2", "qwen3")


def hf_layer_types(config: dict[str, Any]) -> list[str] | None:
    """The kind of each layer, as the transformers config class for this
    config.json (a dict) lists it in ``layer_types``; None for a class without
    the field (Llama, Mistral: each layer alike).

    Older checkpoints (Google's Gemma-2, Qwen2's) carry no ``layer_types``;
    their config classes derive it: Gemma-2 alternates sliding and full from
    layer 0; Qwen2/Qwen3 slide the layers from ``max_window_layers`` on, and
    only when ``use_sliding_window`` (default false) leaves a window.
    """
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return list(layer_types)
    num_layers = int(config.get("num_hidden_layers", 0))
    model_type = config.get("model_type")
    if model_type == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if model_type in _QWEN_LAYER_TYPES:
        # The classes' window default is 4096: only an explicit null is none.
        window = config.get("sliding_window", 4096)
        slides = bool(config.get("use_sliding_window", False)) and window is not None
        first = int(config.get("max_window_layers", 28))  # the classes' default
        return [
            "sliding_attention" if slides and i >= first else "full_attention"
            for i in range(num_layers)
        ]
    return None


def model_wide_sliding_window(model_config: ModelConfig) -> int | None:
    """``CacheConfig.sliding_window``: the window only for a model whose every
    layer slides (Mistral), as vLLM's ``create_engine_config`` sets it; with
    mixed kinds (Gemma-2, Qwen2's ``max_window_layers``) it would override the
    full layers, which take their kind from ``layer_types`` in the model.

    Departure: where the config class lists every layer as full (Qwen2 with
    ``max_window_layers`` at or past the last layer), no window either (vLLM
    would set it; HF's model slides no layer).
    """
    layer_types = hf_layer_types(model_config.hf_config_dict)
    if layer_types is not None and set(layer_types) != {"sliding_attention"}:
        return None
    return model_config.get_sliding_window()
