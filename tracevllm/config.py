"""Engine configuration: one dataclass per concern, gathered in ``VllmConfig``.

Mirrors vllm/config/ (``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``,
``ParallelConfig``, ``DeviceConfig``, ``AttentionConfig``, ``ObservabilityConfig``,
vllm/config/speculative.py's ``SpeculativeConfig``, vllm/config/kv_transfer.py's
``KVTransferConfig`` (defined in distributed/kv_transfer/), vllm/config/compilation.py's
``CompilationConfig`` (defined in compilation/config.py) and the ``VllmConfig``
that holds them). Config flows down from ``EngineArgs``
(engine/arg_utils.py); nothing below reads the environment. Left out:
LoRA and structured-output configs. ``TraceConfig``
is tracevllm's own (how much to trace and where to write it).

Every config is a plain picklable dataclass: the whole ``VllmConfig`` is handed
to the engine-core process when it is spawned.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracevllm.compilation.config import (  # noqa: F401 (re-exported)
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    resolve_compilation_config,
    set_cudagraph_sizes,
)

# vLLM's vllm/config/kv_transfer.py; kept beside the KV connectors, re-exported here.
from tracevllm.distributed.kv_transfer.kv_transfer_config import KVTransferConfig

# vLLM's vllm/config/compilation.py; kept beside the compiler, re-exported here.
from tracevllm.logger import init_logger

if TYPE_CHECKING:
    from tracevllm.core.sched.scheduler import Scheduler

logger = init_logger(__name__)


class _HFConfigField:
    """``ModelConfig.hf_config``: set from a dict (config.json) or a transformers
    ``PretrainedConfig``; read as a ``PretrainedConfig`` (vLLM's type), made on
    the first read.

    Why not at once: transformers imports torch, and the frontend must not
    import torch before it forks the engine process (see model_loader.py).
    So the frontend reads ``hf_config_dict`` (config.json as written), which
    is what ModelConfig's own properties read; the model, in the engine,
    reads ``hf_config``.
    """

    def __get__(self, obj: ModelConfig | None, objtype: type | None = None) -> Any:
        if obj is None:
            return None  # the field's default
        config = obj.__dict__.get("_hf_config")
        if config is None and obj.hf_config_dict:
            config = obj.__dict__["_hf_config"] = _make_hf_config(obj.model, obj.hf_config_dict)
        return config

    def __set__(self, obj: ModelConfig, value: Any) -> None:
        if value is self:  # not given: the dataclass passes its default, this field
            value = None
        if value is None or isinstance(value, dict):
            obj.__dict__["hf_config_dict"] = dict(value or {})
            obj.__dict__["_hf_config"] = None
        else:  # a PretrainedConfig
            obj.__dict__["hf_config_dict"] = value.to_dict()
            obj.__dict__["_hf_config"] = value


@dataclass
class ModelConfig:
    """The model: a local HF directory (config.json + *.safetensors + tokenizer).

    ``model`` is already resolved to a directory by ``EngineArgs`` (the default
    model and ``.gguf`` files are converted once, see model_loader.py).
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # Most logprobs a request may ask for (vLLM's default 20; -1: the vocabulary).
    max_logprobs: int = 20
    # vLLM's: True runs the model eagerly (compilation mode NONE). None (not
    # given) is settled in VllmConfig: True unless compilation was asked for
    # (tracevllm's default; compilation/config.py says why).
    enforce_eager: bool | None = None
    # Where default sampling parameters come from: "auto" (the model's
    # generation_config.json), "vllm" (vLLM's neutral defaults) or a directory.
    generation_config: str = "auto"
    # config.json as written (set through hf_config; ModelConfig's properties
    # read it), and the PretrainedConfig made from it on first read.
    hf_config_dict: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _hf_config: Any = field(default=None, init=False, repr=False, compare=False)
    # The model's HF config: pass a dict or a PretrainedConfig, or nothing to
    # read <model>/config.json; read, it is a PretrainedConfig (_HFConfigField).
    hf_config: Any = field(default=_HFConfigField(), repr=False, compare=False)
    # Set in __post_init__ from dtype and hf_config.
    torch_dtype: str = "float32"
    # Out-of-tree models registered when this config was made, carried to
    # the engine process (ModelRegistry.register_model).
    registered_models: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = self.model
        path = os.path.join(self.model, "config.json")
        from_file = not self.hf_config_dict
        if from_file:
            self.hf_config = _read_hf_config(path)
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 or >= 0, got {self.max_logprobs}.")
        from tracevllm.model_executor.models.registry import ModelRegistry

        # Refused here, before the engine process starts (vLLM's error).
        arch = ModelRegistry.resolve_arch(self.hf_config_dict.get("architectures") or [])
        self.registered_models = ModelRegistry.out_of_tree_models()
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if from_file and key not in self.hf_config_dict:
                raise ValueError(
                    f"{path} has no {key!r}, which a {arch} config.json must have: "
                    "add it, or write config.json again with the model's transformers "
                    "config class (save_pretrained writes every field)."
                )
        # fp32 on CPU (DESIGN.md §5): "auto" means float32 here, as vLLM's CPU
        # backend upcasts half types it cannot run fast.
        allowed = ("auto", "float32", "float16", "bfloat16")
        if self.dtype not in allowed:
            raise ValueError(f"dtype must be one of {allowed}, got {self.dtype!r}.")
        self.torch_dtype = "float32" if self.dtype == "auto" else self.dtype
        derived = self.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = derived
        elif not 0 < self.max_model_len <= derived:
            raise ValueError(
                f"max_model_len must be in [1, {derived}] (the model's "
                f"max_position_embeddings), got {self.max_model_len}."
            )

    # --- what the rest of the engine asks of the model ---------------------
    @property
    def architecture(self) -> str:
        from tracevllm.model_executor.models.registry import ModelRegistry

        return ModelRegistry.resolve_arch(self.hf_config_dict["architectures"])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config_dict["vocab_size"])

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config_dict["hidden_size"])

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config_dict.get("max_position_embeddings", 2048))

    def get_total_num_hidden_layers(self) -> int:
        return int(self.hf_config_dict["num_hidden_layers"])

    def get_layers_start_end_indices(self, parallel_config: ParallelConfig) -> tuple[int, int]:
        """The decoder layers ``[start, end)`` of this worker's pipeline stage."""
        from tracevllm.distributed.utils import get_pp_indices

        pp_size = parallel_config.pipeline_parallel_size
        pp_rank = parallel_config.rank // parallel_config.tensor_parallel_size % pp_size
        return get_pp_indices(self.get_total_num_hidden_layers(), pp_rank, pp_size)

    def get_num_layers(self, parallel_config: ParallelConfig | None = None) -> int:
        """Decoder layers in all (no ``parallel_config``) or on this worker's stage."""
        if parallel_config is None:
            return self.get_total_num_hidden_layers()
        start, end = self.get_layers_start_end_indices(parallel_config)
        return end - start

    def get_num_attention_heads(self, parallel_config: ParallelConfig | None = None) -> int:
        """Query heads in all (no ``parallel_config``) or on each TP rank."""
        total = int(self.hf_config_dict["num_attention_heads"])
        return total if parallel_config is None else total // parallel_config.tensor_parallel_size

    def get_total_num_kv_heads(self) -> int:
        return int(
            self.hf_config_dict.get("num_key_value_heads")
            or self.hf_config_dict["num_attention_heads"]
        )

    def get_num_kv_heads(self, parallel_config: ParallelConfig | None = None) -> int:
        """KV heads in all (no ``parallel_config``) or on each TP rank: at least
        one, since fewer KV heads than ranks are copied (QKVParallelLinear)."""
        total = self.get_total_num_kv_heads()
        if parallel_config is None:
            return total
        return max(1, total // parallel_config.tensor_parallel_size)

    def get_head_size(self) -> int:
        head_dim = self.hf_config_dict.get("head_dim")
        if head_dim:
            return int(head_dim)
        return self.hidden_size // self.get_num_attention_heads()

    def get_sliding_window(self) -> int | None:
        """The HF config's ``sliding_window``, if the model uses one (vLLM's).

        Read from config.json as written: a window of 0 is none, and so is
        one that ``use_sliding_window`` false turns off (Qwen's config classes
        clear it, and default the flag to false; vLLM reads the config class).
        """
        config = self.hf_config_dict
        flag_default = config.get("model_type") not in _USE_SLIDING_WINDOW_DEFAULT_FALSE
        if not config.get("use_sliding_window", flag_default):
            return None
        window = config.get("sliding_window")
        return int(window) if window else None

    def get_max_model_len(self) -> int:
        assert self.max_model_len is not None
        return self.max_model_len

    def verify_with_parallel_config(self, parallel_config: ParallelConfig) -> None:
        """vLLM's check that tensor parallelism can split the attention heads,
        and that pipeline parallelism gives every stage some of the layers."""
        tensor_parallel_size = parallel_config.tensor_parallel_size
        # Read only when there is something to split: a config without heads
        # (the labs' schedulers) is fine on one rank.
        if tensor_parallel_size > 1:
            total_num_attention_heads = self.get_num_attention_heads()
            if total_num_attention_heads % tensor_parallel_size != 0:
                raise ValueError(
                    f"Total number of attention heads ({total_num_attention_heads})"
                    " must be divisible by tensor parallel size "
                    f"({tensor_parallel_size})."
                )
        if parallel_config.pipeline_parallel_size > 1:
            self._verify_pp_partition(parallel_config.pipeline_parallel_size)

    def _verify_pp_partition(self, pp_size: int) -> None:
        """Every pipeline stage must hold at least one decoder layer.

        tracevllm's own check, made here so that it fails before any worker
        starts: vLLM makes none, and a stage of no layers has no attention
        layer, so no KV cache to size. ``get_pp_indices`` is called for each
        stage as the workers will call it, so a bad
        ``TRACEVLLM_PP_LAYER_PARTITION`` fails here too, with vLLM's errors.
        """
        from tracevllm import envs
        from tracevllm.distributed.utils import get_pp_indices

        num_layers = self.get_total_num_hidden_layers()
        if pp_size > num_layers:
            raise ValueError(
                f"pipeline_parallel_size ({pp_size}) must not be larger than the model's "
                f"number of hidden layers ({num_layers}): each pipeline stage needs at "
                f"least one layer, so pipeline_parallel_size may be 1 to {num_layers}."
            )
        stages = [get_pp_indices(num_layers, pp_rank, pp_size) for pp_rank in range(pp_size)]
        sizes = [end - start for start, end in stages]
        if min(sizes) < 1:
            raise ValueError(
                f"TRACEVLLM_PP_LAYER_PARTITION={envs.TRACEVLLM_PP_LAYER_PARTITION!r} gives "
                f"pipeline stages {sizes} layers: each of the {pp_size} stages needs at "
                f"least one of the model's {num_layers} layers."
            )

    def try_get_generation_config(self) -> dict[str, Any]:
        """The non-default fields of the model's generation config (stop
        tokens, sampling defaults); {} when there is none."""
        src = self.model if self.generation_config in ("auto", "vllm") else self.generation_config
        if not os.path.isfile(os.path.join(src, "generation_config.json")):
            return {}
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(src).to_diff_dict()

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """Default SamplingParams fields from the generation config (vLLM's
        list: repetition_penalty, temperature, top_k, top_p, min_p, and
        max_new_tokens as max_tokens). Nothing under ``generation_config="vllm"``."""
        if self.generation_config == "vllm":
            return {}
        config = self.try_get_generation_config()
        names = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
        diff = {name: config[name] for name in names if config.get(name) is not None}
        if "max_new_tokens" in diff:
            diff["max_tokens"] = diff.pop("max_new_tokens")
        return diff


# Config classes whose ``use_sliding_window`` defaults to false (transformers'
# configuration_qwen2.py, _qwen2_moe.py, _qwen3.py, _qwen3_moe.py): their
# config.json's sliding_window is no window without the flag.
_USE_SLIDING_WINDOW_DEFAULT_FALSE = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def _make_hf_config(model: str, config_dict: dict[str, Any]) -> Any:
    """The transformers ``PretrainedConfig`` for config.json: vLLM's
    ``get_config``, ``AutoConfig.from_pretrained`` on the local directory. A
    dict that is not the directory's config.json is made into its model
    type's config class; a ``model_type`` transformers does not know (an
    out-of-tree model's own) into a plain ``PretrainedConfig``."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = str(config_dict.get("model_type"))
    if model_type not in CONFIG_MAPPING:
        return PretrainedConfig.from_dict(config_dict)
    path = os.path.join(model, "config.json")
    if os.path.isfile(path) and _read_hf_config(path) == config_dict:
        return AutoConfig.from_pretrained(model)
    return CONFIG_MAPPING[model_type].from_dict(config_dict)


def _read_hf_config(path: str) -> dict[str, Any]:
    """config.json as a dict; a broken file is a ValueError that names it."""
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}.")
    return config


# vLLM's KVOffloadingBackend literals.
KV_OFFLOADING_BACKENDS = ("native", "lmcache")


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache. vLLM: block size 16, prefix caching on, sha256."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    # Fix the number of KV blocks instead of deriving it from memory.
    num_gpu_blocks_override: int | None = None
    # Memory for the KV cache, all layers (vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE).
    kv_cache_memory_bytes: int = 1 << 30
    # Set by EngineCore._initialize_kv_caches.
    num_gpu_blocks: int | None = None
    # The model's sliding window when every layer has it (Mistral); set from
    # ModelConfig by EngineArgs, as vLLM. Per-layer windows (Gemma-2) go to
    # each Attention as per_layer_sliding_window instead.
    sliding_window: int | None = None
    # vLLM's KV offloading: a second tier of this many GiB (None: off), through
    # kv_offloading_backend; VllmConfig turns it into the KV connector's config.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"

    def __post_init__(self) -> None:
        # Types first: a bool is not an int (True would pass as block_size 1).
        ints = {"block_size": self.block_size, "kv_cache_memory_bytes": self.kv_cache_memory_bytes}
        if self.num_gpu_blocks_override is not None:
            ints["num_gpu_blocks_override"] = self.num_gpu_blocks_override
        for name, value in ints.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(
                f"block_size must be a power of two in [1, 256], got {self.block_size}."
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                "num_gpu_blocks_override must be at least 2 (block 0 is the null "
                f"block), got {self.num_gpu_blocks_override}."
            )
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}."
            )
        if self.prefix_caching_hash_algo != "sha256":
            # vLLM also offers sha256_cbor, xxhash and xxhash_cbor.
            raise ValueError(
                "prefix_caching_hash_algo must be 'sha256' (vLLM's default; tracevllm "
                f"has no other), got {self.prefix_caching_hash_algo!r}."
            )
        self._check_kv_offloading()

    def _check_kv_offloading(self) -> None:
        """vLLM's ``float | None`` and ``Literal["native", "lmcache"]``, checked
        as its pydantic layer does (a bool is not a number), plus a range."""
        size = self.kv_offloading_size
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int | float):
                raise TypeError(
                    f"kv_offloading_size must be a number of GiB, got {type(size).__name__}."
                )
            if not math.isfinite(size) or size <= 0:
                raise ValueError(
                    f"kv_offloading_size must be a positive, finite number of GiB, got {size}."
                )
        backend = self.kv_offloading_backend
        if not isinstance(backend, str):
            raise TypeError(
                f"kv_offloading_backend must be a string, got {type(backend).__name__}."
            )
        if backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(
                f"kv_offloading_backend must be one of {list(KV_OFFLOADING_BACKENDS)}, "
                f"got {backend!r}."
            )
        if backend == "lmcache":
            raise ValueError(
                "kv_offloading_backend 'lmcache' needs LMCache's LMCacheConnectorV1, which "
                "tracevllm does not have: use 'native' (the OffloadingConnector's CPU tier)."
            )


@dataclass(slots=True)
class SchedulerConfig:
    """Batching limits. Defaults are vLLM's for the LLM class on CPU."""

    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # Cap on one request's prefill tokens per step (0: no cap).
    long_prefill_token_threshold: int = 0
    # "fcfs" or "priority" (vLLM's SchedulerPolicy).
    policy: str = "fcfs"
    async_scheduling: bool | None = None
    """Schedule step N+1 while the workers run step N (``AsyncScheduler`` and
    a batch queue of two). None is resolved by ``VllmConfig``: vLLM turns it
    on wherever the executor and the features allow; tracevllm turns it off,
    since its reference is vLLM's synchronous path (``--no-async-scheduling``),
    the one the book walks through. True asks for it and refuses what
    cannot run with it."""

    def __post_init__(self) -> None:
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError(
                "async_scheduling must be True, False or None, "
                f"got {type(self.async_scheduling).__name__}."
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}."
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}."
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled: "
                "a prompt must fit in one step."
            )

    @property
    def max_num_scheduled_tokens(self) -> int:
        return self.max_num_batched_tokens

    def get_scheduler_cls(self) -> type[Scheduler]:
        """``AsyncScheduler`` with async scheduling, else ``Scheduler`` (vLLM's,
        less its ``scheduler_cls`` override)."""
        if self.async_scheduling:
            from tracevllm.core.sched.async_scheduler import AsyncScheduler

            return AsyncScheduler
        from tracevllm.core.sched.scheduler import Scheduler

        return Scheduler


# --8<-- [start:parallel_config]
# The executors distributed_executor_backend names (vLLM also has
# "external_launcher" for torchrun).
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(slots=True)
class ParallelConfig:
    """How the model is spread over processes: vllm/config/parallel.py.

    ``world_size`` is T x P, the number of workers one engine drives (one
    process each with ``"mp"``, one Ray actor each with ``"ray"``, the
    engine's own process with ``"uni"``); data parallelism runs D such
    engines. Left out: context and expert parallelism, multi-node ``mp``
    (``nnodes``, ``node_rank``), dual batch overlap, NUMA binding.
    """

    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # "uni" | "mp" | "ray", an Executor subclass or its import path; None:
    # chosen in __post_init__ as vLLM does.
    distributed_executor_backend: str | type | None = None
    # torch.distributed's init timeout (None: torch's default).
    distributed_timeout_seconds: int | None = None
    # Global rank of this worker (set in each worker's copy of the config).
    rank: int = 0
    # The Ray placement group the "ray" backend places its workers by (a
    # ray.util.placement_group.PlacementGroup; set by initialize_ray_cluster).
    placement_group: Any = None
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("pipeline_parallel_size", "tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank ({self.data_parallel_rank}) must be in the range "
                f"[0, {self.data_parallel_size})"
            )
        self.world_size = self.pipeline_parallel_size * self.tensor_parallel_size
        self._verify_args()
        if self.distributed_executor_backend is None:
            # vLLM: "mp" when more than one worker fits on this node (or
            # "ray" inside a Ray placement group), "uni" for one.
            if self.world_size_across_dp > 1:
                self.distributed_executor_backend = "ray" if _in_ray_placement_group() else "mp"
            else:
                self.distributed_executor_backend = "uni"
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            # tracevllm's: vLLM's one worker would wait for T x P - 1 peers forever.
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one worker, but world size "
                f"(tensor_parallel_size x pipeline_parallel_size) is {self.world_size}; "
                "use 'mp' or 'ray'."
            )
        if self.use_ray:
            from tracevllm.executor import ray_utils

            ray_utils.assert_ray_available()
        cpus = available_cpu_count()
        if self.world_size > cpus:
            # vLLM refuses more ranks than GPUs; on CPUs the ranks share them.
            logger.warning(
                "World size (%d) is larger than the number of available CPUs (%d): "
                "each rank runs one thread, and they take turns on the CPUs.",
                self.world_size,
                cpus,
            )

    def _verify_args(self) -> None:
        backend = self.distributed_executor_backend
        # A name, or an import path ("package.module.MyExecutor").
        is_name = backend in DISTRIBUTED_EXECUTOR_BACKENDS
        if backend is None or isinstance(backend, str) and (is_name or "." in backend):
            return
        if isinstance(backend, type):
            from tracevllm.executor.abstract import Executor

            if issubclass(backend, Executor):
                return
        raise ValueError(
            f"Unrecognized distributed executor backend {backend!r}. Supported values "
            f"are {', '.join(map(repr, DISTRIBUTED_EXECUTOR_BACKENDS))}, a custom "
            "Executor subclass or its import path."
        )

    @property
    def world_size_across_dp(self) -> int:
        """T x P x D: every worker of every engine."""
        return self.world_size * self.data_parallel_size

    @property
    def use_ray(self) -> bool:
        backend = self.distributed_executor_backend
        return backend == "ray" or (
            isinstance(backend, type) and getattr(backend, "uses_ray", False)
        )


def available_cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask, where there is one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _in_ray_placement_group() -> bool:
    """Inside a Ray placement group (vLLM then picks "ray"); False without Ray."""
    import sys

    ray = sys.modules.get("ray")  # never import Ray just to ask
    if ray is None or not ray.is_initialized():
        return False
    from ray.util import get_current_placement_group

    return get_current_placement_group() is not None


# --8<-- [end:parallel_config]


@dataclass(slots=True)
class DeviceConfig:
    device: str = "cpu"


@dataclass(slots=True)
class AttentionConfig:
    # "cpu_attn" (decodes, short prompts: a C++ kernel; CPU default), "torch"
    # (reference) or "triton" (kernels/, CUDA default). None: by device.
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in (None, "cpu_attn", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be 'cpu_attn', 'torch' or 'triton', got {self.backend!r}."
            )


@dataclass(slots=True)
class ObservabilityConfig:
    # Send spans to an OTLP collector too (vLLM's --otlp-traces-endpoint).
    otlp_traces_endpoint: str | None = None


@dataclass(slots=True)
class TraceConfig:
    """tracevllm's own: how much to trace and where files go.

    detail: "off" (no-op tracer), "request" (request and step spans) or "full"
    (adds per-layer KV write/read and model internals).
    """

    detail: str = "off"
    out_dir: str | None = None
    # Draw each step's views in the terminal as it runs (tracevllm trace).
    live_views: bool = False

    def __post_init__(self) -> None:
        if self.detail not in ("off", "request", "full"):
            raise ValueError(
                f"trace detail must be 'off', 'request' or 'full', got {self.detail!r}."
            )

    @property
    def enabled(self) -> bool:
        return self.detail != "off"


# --8<-- [start:speculative_config]
@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes the drafts, and how many per step.

    ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min":
    a, "prompt_lookup_max": b}`` looks the drafts up in the request's own
    tokens; ``{"method": "draft_model", "model": PATH,
    "num_speculative_tokens": k}`` runs a second, smaller model k times.
    Without ``method``, ``model="ngram"`` means ngram and any other model a
    draft model, as vLLM infers. Left out: EAGLE, MTP, Medusa, suffix
    decoding, parallel drafting, synthetic rejection sampling, draft tensor
    parallelism and quantization.
    """

    num_speculative_tokens: int | None = None
    model: str | None = None
    method: str | None = None
    # ngram: the longest suffix of the context, between these lengths, that
    # occurred before (both None: 5 and 5, vLLM's defaults).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: "greedy" drafts (argmax; the rejection sampler takes them
    # as one-hot) or "probabilistic" (sampled; their probabilities go along).
    draft_sample_method: str = "greedy"
    # Set by EngineArgs: the target's config; the draft's is made from it.
    target_model_config: ModelConfig | None = None
    draft_model_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config's model must be a path, got {self.model!r}.")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(
                "draft_sample_method must be 'greedy' or 'probabilistic', "
                f"got {self.draft_sample_method!r}."
            )
        if self.method is None:
            self.method = "ngram" if self.model in (None, "ngram") else "draft_model"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"Unsupported speculative method: {self.method!r}. tracevllm has "
                f"{list(SPECULATIVE_METHODS)} (vLLM also has eagle, mtp, medusa, suffix ...)."
            )
        k = self.num_speculative_tokens
        if k is None or isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(
                f"speculative_config needs num_speculative_tokens, an int >= 1, got {k!r}."
            )
        if not 1 <= k <= MAX_SPEC_LEN:
            raise ValueError(
                f"Expected num_speculative_tokens to be in [1, {MAX_SPEC_LEN}], got {k}."
            )
        if self.method == "ngram":
            self._init_ngram()
        else:
            self._init_draft_model()

    def _init_ngram(self) -> None:
        if self.model not in (None, "ngram"):
            raise ValueError(f"method 'ngram' takes no model, got model={self.model!r}.")
        self.model = "ngram"
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        assert lo is not None and hi is not None
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    def _init_draft_model(self) -> None:
        if self.model in (None, "ngram"):
            raise ValueError("method 'draft_model' needs a model: the draft model's path.")
        target = self.target_model_config
        if target is None or self.draft_model_config is not None:
            return
        # Same dtype; no longer than the target, nor than the draft can go.
        draft_hf = _read_hf_config(os.path.join(self.model, "config.json"))
        self.draft_model_config = ModelConfig(
            model=self.model,
            dtype=target.dtype,
            seed=target.seed,
            max_model_len=min(
                target.get_max_model_len(), int(draft_hf.get("max_position_embeddings", 2048))
            ),
            hf_config=draft_hf,
        )
        self.verify_equal_vocab_size_if_draft_model()

    def verify_equal_vocab_size_if_draft_model(self) -> None:
        assert self.target_model_config is not None and self.draft_model_config is not None
        target_vocab = self.target_model_config.vocab_size
        draft_vocab = self.draft_model_config.vocab_size
        if target_vocab != draft_vocab:
            raise ValueError(
                "Target and draft model should have the same vocabulary size. "
                f"Target model vocab_size={target_vocab}. Draft model vocab_size="
                f"{draft_vocab}. Using models with different tokenizers can cause "
                "out-of-bounds errors during speculative decoding."
            )

    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_dict(cls, config: dict[str, Any], target: ModelConfig) -> SpeculativeConfig:
        """What ``speculative_config={...}`` gives; unknown keys are refused by name."""
        if not isinstance(config, dict):
            raise TypeError(
                f"speculative_config must be a dict (or JSON object), got {type(config).__name__}."
            )
        known = {"num_speculative_tokens", "model", "method", "prompt_lookup_min",
                 "prompt_lookup_max", "draft_sample_method"}  # fmt: skip
        if unknown := sorted(set(config) - known):
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; tracevllm takes {sorted(known)}."
            )
        return cls(**config, target_model_config=target)


SPECULATIVE_METHODS = ("ngram", "draft_model")
# Most drafts per request per step (vLLM's rejection_sampler.MAX_SPEC_LEN).
MAX_SPEC_LEN = 128


# --8<-- [end:speculative_config]


@dataclass(slots=True)
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    attention_config: AttentionConfig = field(default_factory=AttentionConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    trace_config: TraceConfig = field(default_factory=TraceConfig)
    speculative_config: SpeculativeConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)

    def __post_init__(self) -> None:
        self.model_config.verify_with_parallel_config(self.parallel_config)
        self._post_init_kv_transfer_config()
        self._resolve_compilation()
        if self.parallel_config.pipeline_parallel_size > 1:
            backend = self.parallel_config.distributed_executor_backend
            # vLLM's EngineArgs check: an executor that cannot run stages.
            if backend not in ("mp", "ray") and not getattr(backend, "supports_pp", False):
                name = (
                    "Pipeline Parallelism without Ray distributed executor "
                    "or multiprocessing executor"
                )
                raise NotImplementedError(
                    f"{name} is not supported. We recommend to remove {name} from your config."
                )
            if self.speculative_config is not None:
                # tracevllm's: the drafts of a step still in flight in the
                # batch queue would be scheduled before its tokens are known.
                raise NotImplementedError(
                    "Speculative decoding is not supported with pipeline parallelism "
                    "(pipeline_parallel_size > 1) in tracevllm."
                )
        self._resolve_async_scheduling()

    def _post_init_kv_transfer_config(self) -> None:
        """vLLM's: ``kv_offloading_size`` (backend ``native``) becomes the
        ``OffloadingConnector``'s config, ``kv_role`` ``kv_both`` and
        ``cpu_bytes_to_use`` in ``kv_connector_extra_config``, over any
        ``kv_transfer_config`` given (as vLLM's, which warns of nothing; a
        copy here, the caller's config left as it was)."""
        size = self.cache_config.kv_offloading_size
        if size is None:
            return
        base = self.kv_transfer_config or KVTransferConfig()
        if base.kv_connector not in (None, "OffloadingConnector"):
            logger.warning(
                "kv_offloading_size replaces kv_transfer_config's kv_connector %r with "
                "OffloadingConnector (as vLLM does).",
                base.kv_connector,
            )
        extra = {**base.kv_connector_extra_config, "cpu_bytes_to_use": size * (1 << 30)}
        self.kv_transfer_config = dataclasses.replace(
            base,
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )

    def _resolve_compilation(self) -> None:
        """vLLM's rule, enforce_eager forces mode NONE, and tracevllm's eager
        default (compilation/config.py); what the compiled path cannot run yet
        is refused here, in the frontend."""
        if isinstance(self.compilation_config, dict):
            self.compilation_config = CompilationConfig.from_cli(self.compilation_config)
        self.model_config.enforce_eager = resolve_compilation_config(
            self.compilation_config, self.model_config.enforce_eager, self.device_config.device
        )
        spec = self.speculative_config
        set_cudagraph_sizes(
            self.compilation_config,
            self.scheduler_config.max_num_seqs,
            self.scheduler_config.max_num_batched_tokens,
            (spec.num_speculative_tokens or 0) if spec is not None else 0,
        )
        if self.compilation_config.mode == CompilationMode.NONE:
            return
        parallel = self.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise NotImplementedError(
                "torch.compile with tensor_parallel_size or pipeline_parallel_size > 1 is "
                "not supported in tracevllm yet: pass enforce_eager=True (--enforce-eager)."
            )
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            raise NotImplementedError(
                "torch.compile with a draft model (speculative_config method 'draft_model') "
                "is not supported in tracevllm yet: pass enforce_eager=True (--enforce-eager)."
            )

    # --8<-- [start:resolve_async_scheduling]
    def _resolve_async_scheduling(self) -> None:
        """Turn ``async_scheduling`` None into True or False; refuse True where
        it cannot run (vllm/config/vllm.py, ``VllmConfig.__post_init__``).

        As vLLM: an executor without ``supports_async_scheduling`` refuses an
        explicit True (and None falls back to off); so does n-gram
        speculative decoding, in vLLM's words. Departures: None is off,
        not on (tracevllm's reference is the synchronous path); a draft
        model and pipeline parallelism, which vLLM runs with async
        scheduling, are refused with the flag to drop.
        """
        from tracevllm.executor.abstract import Executor

        scheduler_config = self.scheduler_config
        backend = self.parallel_config.distributed_executor_backend
        executor_supports_async_sched = Executor.get_class(self).supports_async_scheduling()
        if scheduler_config.async_scheduling:
            spec = self.speculative_config
            if spec is not None and spec.method != "draft_model":
                raise ValueError(
                    "Currently, async scheduling is only supported "
                    "with EAGLE/MTP/Draft Model/NGram GPU kind of "
                    "speculative decoding"
                )
            if not executor_supports_async_sched:
                raise ValueError(f"`{backend}` does not support async scheduling yet.")
            if spec is not None:
                raise NotImplementedError(
                    "Async scheduling with a draft model (speculative_config method "
                    "'draft_model') is not supported in tracevllm: drop "
                    "--async-scheduling (async_scheduling=True) or the speculative config."
                )
            if self.parallel_config.pipeline_parallel_size > 1:
                raise NotImplementedError(
                    "Async scheduling with pipeline parallelism (pipeline_parallel_size > 1) "
                    "is not supported in tracevllm: drop --async-scheduling "
                    "(async_scheduling=True); the batch queue already keeps P steps in flight."
                )
        elif scheduler_config.async_scheduling is None:
            # vLLM: on, unless a feature or the executor rules it out.
            scheduler_config.async_scheduling = False
        logger.debug(
            "Asynchronous scheduling is %s.",
            "enabled" if scheduler_config.async_scheduling else "disabled",
        )

    # --8<-- [end:resolve_async_scheduling]


# The config of the engine being built, for layers that need it at construction
# (vllm/config/vllm.py). vLLM's get_current_vllm_config falls back to a default
# VllmConfig(); tracevllm's gives None, and the layer its own defaults.
_current_vllm_config: VllmConfig | None = None


@contextmanager
def set_current_vllm_config(vllm_config: VllmConfig) -> Iterator[None]:
    """Make ``vllm_config`` the current config while the model is built."""
    global _current_vllm_config
    old, _current_vllm_config = _current_vllm_config, vllm_config
    try:
        yield
    finally:
        _current_vllm_config = old


def get_current_vllm_config() -> VllmConfig | None:
    return _current_vllm_config
