"""How the model is compiled: ``CompilationConfig`` and its modes.

Mirrors vllm/config/compilation.py (``CompilationMode``, ``CUDAGraphMode``,
``CompilationConfig`` with vLLM's field names: ``mode``, ``backend``,
``splitting_ops``, ``compile_sizes``, ``cache_dir``, ``inductor_compile_config``,
``cudagraph_mode``, ``cudagraph_capture_sizes``; ``compute_hash``). Left out:
pass_config and the custom passes (fusions), custom_ops, compile ranges
(one dynamic-shape compile covers every size that ``compile_sizes`` does not
name), Inductor graph partition, dynamic_shapes_config, AOT compile. The CUDA
graph fields are checked and kept, but tracevllm captures no CUDA graph yet:
they resolve to NONE / [] (see ``resolve_compilation_config``).

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
    """vLLM's CUDA graph modes; tracevllm captures none yet (always NONE at run time)."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)
    FULL_AND_PIECEWISE = (2, 1)


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
    # CUDA only; checked, kept, resolved to NONE / [] (no CUDA graphs in tracevllm yet).
    cudagraph_mode: CUDAGraphMode | None = None
    cudagraph_capture_sizes: list[int] | None = None
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
    requested = compilation_config.cudagraph_mode
    if requested not in (None, CUDAGraphMode.NONE):
        logger.warning(
            "compilation_config.cudagraph_mode %s: tracevllm captures no CUDA graphs "
            "(device %s); running without.",
            requested.name,
            device,
        )
    compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    compilation_config.cudagraph_capture_sizes = []
    return enforce_eager


# --8<-- [end:resolve_compilation_config]
