"""Process settings for running the engine on CPUs: threads and the allocator.

Mirrors two things vLLM's CPU backend does before its worker runs a step:

- vllm/utils/ompmultiprocessing.py (``OMPProcessManager.reserve_cpu_num``):
  vLLM's worker leaves one CPU to the frontend process and gives its
  OpenMP threads the rest (``VLLM_CPU_NUM_OF_RESERVED_CPU``, default 1).
  tracevllm reads ``TRACEVLLM_CPU_NUM_OF_RESERVED_CPU`` the same way but
  reserves none by default: in an offline run the frontend sleeps while a
  step runs, and on a 2-core machine the engine did 162-170 tok/s with both
  cores against 109-133 with one (``make bench``'s workload, same hour). A
  busy server frontend is the case for reserving one. vLLM also pins each
  thread to a core (``VLLM_CPU_OMP_THREADS_BIND``); tracevllm leaves
  placement to the OS.
- vllm/platforms/cpu.py (``check_and_update_config``) preloads tcmalloc into
  the worker. A decode step allocates and frees hundreds of tensors of
  hundreds of KB to a few MB; glibc's malloc serves those with fresh
  ``mmap``\\ s and hands them back on free, so every step pays page faults on
  memory it had a moment ago. tracevllm keeps glibc and tells it, with
  ``mallopt``, to serve blocks up to 32 MiB from its heap and to keep freed
  memory: the same effect, no preloaded library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from tracevllm import envs

logger = logging.getLogger(__name__)

# --8<-- [start:tune_malloc]
# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap, not from their own mmap (glibc's maximum).
MMAP_THRESHOLD_BYTES = 32 << 20
# Freed memory at the top of the heap is kept up to this much.
TRIM_THRESHOLD_BYTES = 1 << 30


def tune_malloc() -> bool:
    """Keep the engine's step-sized allocations in glibc's heap; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:  # not glibc (macOS, musl): its allocator is left as it is
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


# --8<-- [end:tune_malloc]


def allowed_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def engine_num_threads() -> int:
    """Torch intra-op threads for the engine: ``TRACEVLLM_NUM_THREADS`` when
    set, else every allowed CPU less ``TRACEVLLM_CPU_NUM_OF_RESERVED_CPU``
    (default none), and at least one."""
    if envs.TRACEVLLM_NUM_THREADS > 0:
        return envs.TRACEVLLM_NUM_THREADS
    return max(1, allowed_cpus() - envs.TRACEVLLM_CPU_NUM_OF_RESERVED_CPU)
