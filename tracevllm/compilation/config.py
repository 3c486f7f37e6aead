"""How the model is compiled: ``CompilationConfig`` and its modes.

Mirrors vllm/config/compilation.py (``CompilationMode``, ``CUDAGraphMode``,
``CompilationConfig`` with vLLM's field names: ``mode``, ``backend``,
``splitting_ops``, ``compile_sizes``, ``cache_dir``, ``inductor_compile_config``,
``cudagraph_mode``, ``cudagraph_capture_sizes``, ``custom_ops``; ``compute_hash``).
Left out: pass_config and the custom passes (fusions), compile ranges
(one dynamic-shape compile covers every size that ``compile_sizes`` does not
name), Inductor graph partition, dynamic_shapes_config, AOT compile. CUDA
graphs are captured piecewise when asked for (``cudagraph_mode``
"PIECEWISE", compilation/cuda_graph.py; not yet run on a GPU, so not the
default): the FULL modes, which capture attention too, are taken down to
PIECEWISE, and on CPU every mode resolves to NONE (see
``resolve_compilation_config`` and ``set_cudagraph_sizes``).

No torch here: the frontend builds and checks this config without it, and
the whole ``VllmConfig`` is pickled to the engine process.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from tracevllm.logger import init_logger

logger = init_logger(__name__)


class CompilationMode(enum.IntEnum):
    """vLLM's compilation modes (vllm/config/compilation.py)."""

    NONE = 0  # eager PyTorch, nothing compiled
    STOCK_TORCH_COMPILE = 1  # torch.compile on the model, Dynamo's guards kept
    DYNAMO_TRACE_ONCE = 2  # one Dynamo capture, guards dropped, whole graph to the backend
    VLLM_COMPILE = 3  # one capture, split at the attention ops, pieces to Inductor, cached


class CUDAGraphMode(enum.Enum):
    """vLLM's CUDA graph modes. A tuple is (decode mode, mixed-batch mode).

    tracevllm captures PIECEWISE only: the pieces between attentions, each
    a CUDA graph per padded batch size, with attention run eagerly between.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)
    FULL_AND_PIECEWISE = (2, 1)

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        assert not mode.separate_routine()
        if self.separate_routine():
            return mode.value in self.value
        return self == mode

    def has_piecewise_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)


# The attention custom op the graph is split at (vLLM: vllm::unified_attention_with_output,
# with vllm::unified_kv_cache_update appended when the graph is split by FX). The two run
# back to back, so they land in one splitting piece between two compiled ones.
ATTENTION_OPS = [
    "tracevllm::unified_attention_with_output",
    "tracevllm::unified_kv_cache_update",
]
BACKENDS = ("", "inductor", "eager")


def _positive_ints(name: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise ValueError(f"compilation_config.{name} must be a list of ints, got {value!r}.")
    for x in value:
        # A bool is an int to Python, not to a user.
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(
                f"compilation_config.{name} must hold ints >= 1, got {x!r} in {value!r}."
            )
    return sorted(set(value))


@dataclass
class CompilationConfig:
    """vLLM's ``CompilationConfig``, the fields that matter on tracevllm's path.

    ``mode`` None is resolved by ``resolve_compilation_config``; an int (0-3)
    or a mode name ("VLLM_COMPILE") is taken as vLLM takes it.
    """

    mode: CompilationMode | None = None
    # "" means Inductor (vLLM's default on CPU and CUDA); "eager" runs the
    # captured pieces as they are (Dynamo capture and splitting without Inductor).
    backend: str = ""
    # Ops the graph is split at (VLLM_COMPILE); None means ATTENTION_OPS, [] no split.
    splitting_ops: list[str] | None = None
    # Sizes (num_tokens) compiled for their exact shape as well as the dynamic one.
    compile_sizes: list[int] | None = None
    # Where compiled pieces are kept; "" means
    # $TRACEVLLM_CACHE_DIR/torch_compile_cache/<hash> (chosen in the engine).
    cache_dir: str = ""
    # Inductor options (vLLM's CPU platform sets its own, platforms/cpu.py).
    inductor_compile_config: dict[str, Any] = field(default_factory=dict)
    # CUDA only (NONE / [] on CPU). None: NONE (PIECEWISE must be asked for
    # until a GPU run has checked it); the sizes: vLLM's default list up to
    # max_cudagraph_capture_size.
    cudagraph_mode: CUDAGraphMode | None = None
    cudagraph_capture_sizes: list[int] | None = None
    # None: min(max_num_seqs * decode query length * 2, 512), as vLLM.
    max_cudagraph_capture_size: int | None = None
    # Which layers run their own kernels (CustomOp.forward_cpu) rather than
    # forward_native: "all" or "none", then "+name" / "-name" for one
    # (rms_norm, silu_and_mul, rotary_embedding). Neither "all" nor "none":
    # "none" when Inductor compiles (it fuses the native ops), else "all".
    custom_ops: list[str] = field(default_factory=list)
    # Set while compiling (not user input, left out of the hash as in vLLM).
    local_cache_dir: str = field(default="", repr=False)
    traced_files: set[str] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.mode = _parse_mode(self.mode)
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(
                f"compilation_config.backend must be one of {list(BACKENDS)} "
                f"('' is inductor), got {self.backend!r}."
            )
        ops = self.splitting_ops
        if ops is not None and (
            not isinstance(ops, list) or not all(isinstance(op, str) and "::" in op for op in ops)
        ):
            raise ValueError(
                "compilation_config.splitting_ops must be a list of op names "
                f"'namespace::name' (e.g. {ATTENTION_OPS[0]!r}), got {ops!r}."
            )
        if self.compile_sizes is not None:
            self.compile_sizes = _positive_ints("compile_sizes", self.compile_sizes)
        if not isinstance(self.cache_dir, str):
            raise ValueError(f"compilation_config.cache_dir must be a str, got {self.cache_dir!r}.")
        if not isinstance(self.inductor_compile_config, dict):
            raise ValueError(
                "compilation_config.inductor_compile_config must be a dict, "
                f"got {self.inductor_compile_config!r}."
            )
        for key, value in self.inductor_compile_config.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(
                    f"compilation_config.inductor_compile_config[{key!r}] must be finite."
                )
        if self.cudagraph_mode is not None and not isinstance(self.cudagraph_mode, CUDAGraphMode):
            names = list(CUDAGraphMode.__members__)
            if not isinstance(self.cudagraph_mode, str) or self.cudagraph_mode.upper() not in names:
                raise ValueError(
                    f"compilation_config.cudagraph_mode must be one of {names}, "
                    f"got {self.cudagraph_mode!r}."
                )
            self.cudagraph_mode = CUDAGraphMode[self.cudagraph_mode.upper()]
        if self.cudagraph_capture_sizes is not None:
            self.cudagraph_capture_sizes = _positive_ints(
                "cudagraph_capture_sizes", self.cudagraph_capture_sizes
            )
        ops_ = self.custom_ops
        if not isinstance(ops_, list) or not all(
            isinstance(op, str) and (op in ("all", "none") or op[:1] in "+-" and len(op) > 1)
            for op in ops_
        ):
            raise ValueError(
                'compilation_config.custom_ops must be a list of "all", "none", "+name" or '
                f'"-name" (e.g. ["none", "+rms_norm"]), got {ops_!r}.'
            )
        if ops_.count("all") + ops_.count("none") > 1:
            raise ValueError(
                f'compilation_config.custom_ops takes one of "all" and "none", got {ops_!r}.'
            )
        enabled = {op[1:] for op in ops_ if op[0] == "+"}
        both = sorted(enabled & {op[1:] for op in ops_ if op[0] == "-"})
        if both:
            raise ValueError(
                f"compilation_config.custom_ops cannot both enable and disable {both[0]!r}: "
                f"got {ops_!r}."
            )
        size = self.max_cudagraph_capture_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                f"compilation_config.max_cudagraph_capture_size must be an int >= 1, got {size!r}."
            )

    @classmethod
    def from_cli(cls, value: str | dict[str, Any] | CompilationConfig) -> CompilationConfig:
        """``--compilation-config '{"mode": 3, "compile_sizes": [1, 2]}'`` or a dict."""
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"compilation_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config must be a JSON object, got {value!r}.")
        known = {f.name for f in fields(cls) if f.repr}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"compilation_config has no field {unknown[0]!r} in tracevllm; "
                f"it takes {sorted(known)}."
            )
        return cls(**value)

    def compute_hash(self) -> str:
        """What changes the compiled code (vLLM's ``compute_hash``: every field
        but the paths and run-time records)."""
        factors = {
            "mode": int(self.mode) if self.mode is not None else None,
            "backend": self.backend or "inductor",
            "splitting_ops": self.splitting_ops,
            "compile_sizes": self.compile_sizes,
            "inductor_compile_config": sorted(
                (k, repr(v)) for k, v in self.inductor_compile_config.items()
            ),
            "cudagraph_mode": self.cudagraph_mode.name if self.cudagraph_mode else None,
            "cudagraph_capture_sizes": self.cudagraph_capture_sizes,
            "max_cudagraph_capture_size": self.max_cudagraph_capture_size,
            "custom_ops": self.custom_ops,
        }
        return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:10]


def _parse_mode(value: Any) -> CompilationMode | None:
    """vLLM's ``validate_mode_before``: an int 0-3 or a mode name."""
    if value is None or isinstance(value, CompilationMode):
        return value
    names = list(CompilationMode.__members__)
    if isinstance(value, str):
        if value.upper() in names:
            return CompilationMode[value.upper()]
        if value.isdigit():
            value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
        return CompilationMode(value)
    raise ValueError(f"compilation_config.mode must be 0-3 or one of {names}, got {value!r}.")


# --8<-- [start:resolve_compilation_config]
def resolve_compilation_config(
    compilation_config: CompilationConfig, enforce_eager: bool | None, device: str
) -> bool:
    """Settle ``mode`` and ``enforce_eager``; returns ``enforce_eager``.

    vLLM's rule (vllm/config/vllm.py): ``enforce_eager=True`` forces mode
    NONE, whatever the compilation config says; else an unset mode is
    VLLM_COMPILE. tracevllm's default differs: ``enforce_eager`` None (not
    given) resolves to True unless compilation was asked for (a mode other
    than NONE, ``-O1``-``-O3``, or ``enforce_eager=False``). Compiling has not
    yet been shown faster than eager on the reference 2-core CPU in a quiet
    benchmark, and it costs a compile at the first start; the default flips
    once it has.
    """
    mode = compilation_config.mode
    if enforce_eager is None:
        enforce_eager = mode is None or mode == CompilationMode.NONE
    if enforce_eager:
        if mode not in (None, CompilationMode.NONE):
            logger.warning(
                "Enforce eager set, disabling torch.compile: compilation_config.mode %s "
                "becomes NONE.",
                mode.name,
            )
        compilation_config.mode = CompilationMode.NONE
    elif mode is None:
        compilation_config.mode = CompilationMode.VLLM_COMPILE
    if compilation_config.mode == CompilationMode.NONE and not enforce_eager:
        enforce_eager = True  # mode NONE asked for explicitly: nothing is compiled
    if compilation_config.splitting_ops is None:
        compilation_config.splitting_ops = list(ATTENTION_OPS)
    if compilation_config.compile_sizes is None:
        compilation_config.compile_sizes = []
    ops = compilation_config.custom_ops
    if "all" not in ops and "none" not in ops:
        # vLLM's rule: Inductor fuses the native ops into its own kernels, so
        # the layers' kernels are off when it compiles, on otherwise.
        inductor = compilation_config.backend in ("", "inductor")
        compiled = compilation_config.mode != CompilationMode.NONE
        ops.append("none" if compiled and inductor else "all")
    compilation_config.cudagraph_mode = _resolve_cudagraph_mode(
        compilation_config.cudagraph_mode,
        compilation_config.mode,
        device,
        compilation_config.splitting_ops,
    )
    return enforce_eager


def _resolve_cudagraph_mode(
    requested: CUDAGraphMode | None,
    mode: CompilationMode | None,
    device: str,
    splitting_ops: list[str] | None = None,
) -> CUDAGraphMode:
    """vLLM's default on CUDA is FULL_AND_PIECEWISE; tracevllm's is NONE for now.

    tracevllm's PIECEWISE graphs are tested on CPU up to the capture (the
    padded steps, the fixed buffers, the dispatch) but have not yet run on
    a GPU (the one GPU run so far stopped earlier, in the compile, on torch
    2.11): they are asked for with ``cudagraph_mode`` "PIECEWISE", and the
    default becomes PIECEWISE once ``bash benchmarks/gpu_check.sh`` has
    shown them lossless. Piecewise graphs need the graph split at both
    attention ops (VLLM_COMPILE, ``splitting_ops`` holding ATTENTION_OPS):
    an attention op inside a captured piece would be recorded as nothing
    (it does no work at capture) and skipped at every replay, so without
    the split the mode is NONE, as vLLM makes it. FULL_AND_PIECEWISE comes
    down to PIECEWISE, as vLLM does for a backend without full graphs;
    FULL and FULL_DECODE_ONLY are refused, as vLLM refuses them there:
    tracevllm's attention builds its metadata anew each step and cannot be
    captured. No CUDA graphs on CPU.
    """
    if device != "cuda" or mode != CompilationMode.VLLM_COMPILE:
        if requested not in (None, CUDAGraphMode.NONE):
            logger.warning(
                "compilation_config.cudagraph_mode %s needs mode VLLM_COMPILE on CUDA "
                "(here: mode %s on %s); running without CUDA graphs.",
                requested.name,
                mode.name if mode is not None else None,
                device,
            )
        return CUDAGraphMode.NONE
    if requested is None or requested == CUDAGraphMode.NONE:
        return CUDAGraphMode.NONE
    if requested in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY):
        raise ValueError(
            f"compilation_config.cudagraph_mode {requested.name}: tracevllm's attention "
            "backends build their metadata each step and cannot be captured whole; use "
            "'PIECEWISE' (attention runs eagerly between the captured pieces) or 'NONE'."
        )
    missing = [op for op in ATTENTION_OPS if op not in (splitting_ops or [])]
    if missing:
        logger.warning(
            "compilation_config.cudagraph_mode %s needs the graph split at the attention "
            "ops; splitting_ops lacks %s: running without CUDA graphs.",
            requested.name,
            missing,
        )
        return CUDAGraphMode.NONE
    if requested == CUDAGraphMode.FULL_AND_PIECEWISE:
        logger.warning(
            "compilation_config.cudagraph_mode FULL_AND_PIECEWISE: tracevllm's attention "
            "backends cannot be captured whole; using PIECEWISE."
        )
    return CUDAGraphMode.PIECEWISE


# --8<-- [start:set_cudagraph_sizes]
def set_cudagraph_sizes(
    compilation_config: CompilationConfig,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_speculative_tokens: int = 0,
) -> None:
    """vLLM's ``VllmConfig._set_cudagraph_sizes``: the batch sizes (tokens) captured.

    By default 1, 2, 4, then every 8 below 256 and every 16 from 256, up to
    ``max_cudagraph_capture_size`` (min(max_num_seqs * decode query length
    * 2, 512), never above max_num_batched_tokens), and max_num_batched_tokens
    itself when it fits. A step of n tokens runs the smallest captured size
    >= n (its padding does nothing); a larger step runs without graphs.
    """
    cc = compilation_config
    if cc.cudagraph_mode in (None, CUDAGraphMode.NONE):
        cc.cudagraph_capture_sizes = []
        cc.max_cudagraph_capture_size = 0
        return
    max_size = cc.max_cudagraph_capture_size
    if max_size is None:
        max_size = min(max_num_seqs * (1 + num_speculative_tokens) * 2, 512)
    if max_size > max_num_batched_tokens:
        if cc.max_cudagraph_capture_size is not None:
            logger.warning(
                "compilation_config.max_cudagraph_capture_size %d is above "
                "max_num_batched_tokens %d: capturing up to %d.",
                max_size,
                max_num_batched_tokens,
                max_num_batched_tokens,
            )
        max_size = max_num_batched_tokens
    if cc.cudagraph_capture_sizes is not None:
        given = cc.cudagraph_capture_sizes
        sizes = [s for s in given if s <= max_num_batched_tokens]
        if not sizes:
            raise ValueError(
                f"compilation_config.cudagraph_capture_sizes {given} holds no size "
                f"<= max_num_batched_tokens {max_num_batched_tokens}; give at least one."
            )
        asked = cc.max_cudagraph_capture_size
        if asked is not None and asked != max(given):
            raise ValueError(
                f"compilation_config.max_cudagraph_capture_size {asked} and "
                f"cudagraph_capture_sizes {given} disagree: give one, or make the max "
                "the largest size."
            )
        max_size = max(sizes)
    else:
        sizes = [s for s in (1, 2, 4) if s <= max_size]
        sizes += list(range(8, min(max_size + 1, 256), 8))
        sizes += list(range(256, max_size + 1, 16))
        if max_num_batched_tokens <= max_size:
            sizes.append(max_num_batched_tokens)
    cc.cudagraph_capture_sizes = sorted(set(sizes))
    cc.max_cudagraph_capture_size = cc.cudagraph_capture_sizes[-1]


# --8<-- [end:set_cudagraph_sizes]


# --8<-- [end:resolve_compilation_config]
