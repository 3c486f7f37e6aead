"""Process settings for running the engine on CPUs: threads, the allocator, Inductor.

Mirrors vllm/utils/ompmultiprocessing.py and vllm/v1/worker/cpu_worker.py:
two things vLLM's CPU backend does before its worker runs a step.

- vllm/utils/ompmultiprocessing.py (``OMPProcessManager.reserve_cpu_num``):
  vLLM's worker leaves one CPU to the frontend process and gives its
  OpenMP threads the rest (``VLLM_CPU_NUM_OF_RESERVED_CPU``, default 1).
  tracevllm reads ``TRACEVLLM_CPU_NUM_OF_RESERVED_CPU`` the same way, and
  ``TRACEVLLM_NUM_THREADS`` as a count; either one, set, fixes the count.
  Set neither and, with one rank, the count adapts while the engine runs
  (``adaptive_threads``; tracevllm/worker/cpu_threads.py), starting from
  torch's own (one per physical core, or ``OMP_NUM_THREADS``). Measured on
  a 2-core machine, ``make bench``'s workload: every core to OpenMP did
  169 tok/s quiet but 52 beside one busy process (a descheduled thread
  stalls every parallel region at its barrier), one core reserved did 116
  and 128: neither fixed count wins both, so the default times steps at
  its count and one fewer now and then and keeps the faster
  (``make bench-threads`` measures the three side by side). Those figures
  are the two fixed counts'. The adaptive count's own, from ``make bench``
  (benchmarks/results/bench.json, which also runs the count fixed): beside
  one busy process it dropped to one thread, 2.39x both cores fixed
  (2026-12-03), 2.01x and 1.91x (2026-12-04); quiet it kept both, 1.02x,
  0.90x and 1.00x the fixed count (within the runs' spread). Against vLLM compiled, one
  thread on one core, under load: 1.33x, 0.91x and 1.06x in three runs,
  as the busy process left vLLM's bound core alone or not, and 1.21x with
  the decodes' attention kernel (2026-12-04). Served (``make
  bench-serve``, same day): 1.71x vLLM's server quiet, 1.07x under load;
  in the evening, with the first probe on warm-up dummy steps, 1.49x and 1.43x
  (vLLM's own busy figure moved from 107.6 to 90.2 between the two: one run
  says little).
  Under load both servers compute on one thread, and a one-thread step is
  about four fifths oneDNN matmuls in both (the README's serving section);
  two half-batches on two threads of one OpenMP thread each measured 0.85x
  to 1.16x one thread beside a busy core (benchmarks/bench_split_batch.py),
  so the engine keeps one batch. OpenMP's wait policy was measured too
  (``OMP_WAIT_POLICY=PASSIVE make bench-threads``: waiting threads sleep at
  once, where libgomp's default spins a while first; 16 prompts, one round,
  2026-12-05, not kept as a results file): two threads fixed ran 150 tok/s
  beside the busy process against 72 with the default, still below one
  thread's 157, and 209 quiet against 244. Two threads beside a busy core
  share what the kernel gives them at every barrier, so the policy's count
  is what matters, and the default wait is kept for the quiet case.
  vLLM also pins
  each thread to a core (``VLLM_CPU_OMP_THREADS_BIND``); tracevllm leaves
  placement to the OS.
- vllm/v1/worker/cpu_worker.py (``init_device``) warns when tcmalloc is not
  in ``LD_PRELOAD``, and vLLM's CPU install guide preloads it. A decode step
  allocates and frees hundreds of tensors of hundreds of KB to a few MB;
  glibc's malloc serves those with fresh ``mmap``\\ s and hands them back on
  free, so every step pays page faults on memory it had a moment ago.
  tracevllm keeps glibc and tells it, with ``mallopt``, to serve blocks up to
  32 MiB from its heap and to keep freed memory: the same effect, no
  preloaded library.
- vllm/platforms/cpu.py (``check_and_update_config``) sets Inductor's
  options for CPU (``inductor_compile_config`` below) and turns
  VLLM_COMPILE into DYNAMO_TRACE_ONCE: on CPU vLLM compiles the whole
  graph in one piece, attention op inside, since the split exists to leave
  attention out of CUDA graphs. tracevllm keeps VLLM_COMPILE piecewise on
  CPU too (mode 2 is there for the whole graph): the pieces are what the
  compiled path is about to show, and the attention's Python (and spans)
  runs between them.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from tracevllm import envs
from tracevllm.logger import init_logger

logger = init_logger(__name__)

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
        logger.debug("no glibc mallopt: the allocator is left as it is")
        return False
    mmap_ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    trim_ok = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    logger.debug("mallopt: mmap threshold %s, trim threshold %s", mmap_ok, trim_ok)
    return mmap_ok and trim_ok


# --8<-- [end:tune_malloc]


def engine_num_threads(local_world_size: int = 1) -> int | None:
    """Torch intra-op threads for one rank of the engine, or None to leave torch's default.

    ``TRACEVLLM_NUM_THREADS`` when set; else, with
    ``TRACEVLLM_CPU_NUM_OF_RESERVED_CPU`` set, torch's own count less the
    reserved CPUs (vLLM's arithmetic); else None. With several ranks on this
    machine (tensor or pipeline parallelism), each gets an equal share of
    those, and at least one: more ranks than CPUs take turns.
    """
    if envs.TRACEVLLM_NUM_THREADS > 0:
        return envs.TRACEVLLM_NUM_THREADS
    reserved = envs.TRACEVLLM_CPU_NUM_OF_RESERVED_CPU
    if reserved == 0 and local_world_size == 1:
        return None
    available = torch.get_num_threads()
    if reserved >= available:
        raise ValueError(
            f"TRACEVLLM_CPU_NUM_OF_RESERVED_CPU={reserved} leaves no thread for the engine: "
            f"torch would use {available}. Reserve fewer, or set TRACEVLLM_NUM_THREADS."
        )
    return max(1, (available - reserved) // local_world_size)


def adaptive_threads(local_world_size: int = 1) -> bool:
    """Whether the engine adapts its thread count while it runs (the default).

    Only with one rank on this machine and no count the user fixed: neither
    ``TRACEVLLM_NUM_THREADS`` nor ``TRACEVLLM_CPU_NUM_OF_RESERVED_CPU`` set
    (``0`` set counts: it fixes torch's own count), and
    ``TRACEVLLM_CPU_ADAPTIVE_THREADS`` not ``0``. Several ranks keep their
    fixed equal shares: each would probe on its own while the others wait for
    it at every collective, which has not been measured.
    See tracevllm/worker/cpu_threads.py for the policy and what was measured.
    """
    return (
        local_world_size == 1
        and envs.TRACEVLLM_CPU_ADAPTIVE_THREADS
        and not envs.is_set("TRACEVLLM_NUM_THREADS")
        and not envs.is_set("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU")
    )


# --8<-- [start:inductor_compile_config]
def inductor_compile_config() -> dict[str, object]:
    """vLLM's Inductor options on CPU (vllm/platforms/cpu.py).

    ``cpp.dynamic_threads``: the generated C++ asks OpenMP for its thread
    count at run time instead of baking in the count at compile time, so a
    compiled model follows the engine's thread setting (and a cached one,
    the machine it runs on). The rest skip checks (size and NaN asserts)
    and dead code, and let Inductor fuse epilogues into its kernels.
    """
    return {
        "dce": True,
        "size_asserts": False,
        "nan_asserts": False,
        "epilogue_fusion": True,
        "cpp.dynamic_threads": True,
    }


# --8<-- [end:inductor_compile_config]
