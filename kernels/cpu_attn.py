"""The CPU kernels (csrc/cpu_attn.cpp, cpu_ops.cpp): built once per machine, loaded by each process.

vLLM ships its CPU kernels compiled into ``vllm._C``; tracevllm has no
compiled wheel, so torch's own extension builder
(``torch.utils.cpp_extension.load``, which drives g++ through ninja) compiles
the C++ files the first time a process asks for them, about 15 s,
and keeps the library in torch's extension cache
(``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``): later starts
only load it. The build is named after the instruction set torch detected
(``torch.backends.cpu.get_cpu_capability()``) and compiled for that set, so
a cache shared by machines of different CPUs never hands one of them code it
cannot run. Without a compiler (or ninja) the build fails, and
``cpu_kernels_available()`` says so once and returns False: the engine then
takes the plain-PyTorch attention backend, and the layers their
``forward_native``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tracevllm.logger import init_logger

# Under tracevllm's logger, so its messages print as the engine's do.
logger = init_logger("tracevllm.kernels.cpu_attn")

CSRC = Path(__file__).parent / "csrc"
# The paged attention, and the small ops between the matmuls (RMSNorm,
# SiLU-and-mul, RoPE, the K/V write): one library, torch.ops.tracevllm_C.
SOURCES = [CSRC / "cpu_attn.cpp", CSRC / "cpu_ops.cpp"]
# What they include. torch rebuilds when a source or a flag changes, not a
# header: the header's hash goes in as a flag.
HEADERS = [CSRC / "cpu_vec.h"]

# The instruction sets torch reports, and the compiler flags for each; any
# other (an ARM machine, an old x86) builds for the compiler's default target.
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma"],
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}


def _build_name_and_flags() -> tuple[str, list[str]]:
    isa = torch.backends.cpu.get_cpu_capability()
    flags = _ISA_FLAGS.get(isa, [])
    tag = isa.lower() if flags else "default"
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    return f"tracevllm_C_{tag}", ["-O3", "-fopenmp", *flags, f"-DTRACEVLLM_HEADERS={headers}"]


# A build lock older than this was left by a build that was killed (torch's
# FileBaton waits on it forever); a build takes seconds.
STALE_LOCK_S = 600


def _build_dir(name: str) -> Path:
    """Where torch builds and caches extension ``name`` (TORCH_EXTENSIONS_DIR, else its default)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """The pip-installed ninja (in the venv's bin, not on PATH unless the venv is
    activated) first on PATH while torch builds: torch runs ``ninja`` by name,
    on every load, even when the library is cached."""
    try:
        import ninja

        bin_dir: str | None = ninja.BIN_DIR
    except (ImportError, AttributeError):
        bin_dir = None
    before = os.environ.get("PATH", "")
    if bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


def _why(e: Exception) -> str:
    """The line of a failed build that says why: the compiler's first error, else
    the last line that is not torch's or ninja's wrapping."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower()]
    own = [line for line in lines if not line.startswith(("ninja:", "Error building extension"))]
    return (errors[:1] or own[-1:] or lines[:1] or [""])[0][:300]


@functools.cache
def cpu_kernels_available() -> bool:
    """Build or load the kernels in this process; False, said once, when it cannot be built."""
    from torch.utils.cpp_extension import load

    name, flags = _build_name_and_flags()
    try:
        build_dir = _build_dir(name)
        lock = build_dir / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning(
                "Removing %s, left by a build of the CPU kernels that did not finish.",
                lock,
            )
            lock.unlink(missing_ok=True)
        if not (build_dir / f"{name}.so").exists():
            logger.info(
                "Building the CPU kernels (%s) for this machine, once: about 15 s. "
                "Later starts load them from %s.",
                ", ".join(s.name for s in SOURCES),
                build_dir,
            )
        # -fopenmp compiles at::parallel_for's OpenMP pragmas; the library is
        # not linked to an OpenMP runtime of its own, so the calls resolve to
        # the one torch loaded, and torch's thread count is the kernel's.
        with _ninja_on_path():
            load(name, [str(s) for s in SOURCES], extra_cflags=flags, is_python_module=False)
    except Exception as e:  # no compiler, no ninja, an unwritable cache
        logger.warning(
            "The CPU kernels could not be built (%s: %s); the attention and the layers "
            "take plain PyTorch instead (slower). To build them: a C++ compiler (g++) "
            "and ninja (pip install ninja); set TORCH_EXTENSIONS_DIR if torch's extension "
            "cache is not writable.",
            type(e).__name__,
            _why(e),
        )
        return False
    return True


# --8<-- [start:cpu_attention_with_kv_cache]
def cpu_attention_with_kv_cache(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], float32
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size], float32
    output: torch.Tensor,  # [num_tokens, num_heads, head_size], written for the queries it takes
    query_start_loc: torch.Tensor,  # [num_reqs + 1], int32
    seq_lens: torch.Tensor,  # [num_reqs], int32
    scale: float,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks_per_req], int32
    small_query_limit: int = 0,
) -> None:
    """Causal attention of each query over its request's pages, read in place.

    Every single-token query (a decode) is taken, and a longer one (a prompt,
    a chunk of one, a speculative verify) when the (query token, key) pairs it
    attends, each token its keys up to its own, are at most
    ``small_query_limit``; the others are skipped, their rows of ``output``
    left as they were, for the caller to fill (0: decodes only).
    """
    torch.ops.tracevllm_C.cpu_attention_with_kv_cache(
        query, kv_cache, output, query_start_loc, seq_lens, scale, block_table, small_query_limit
    )


# --8<-- [end:cpu_attention_with_kv_cache]
