"""The engine's CPU process settings: threads left to the frontend, and glibc's malloc."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from tracevllm.platforms import cpu


@pytest.mark.parametrize(
    ("reserved", "threads", "torch_threads", "world", "expected"),
    [
        (None, None, 8, 1, None),  # nothing set: torch's own default stays
        ("1", None, 8, 1, 7),  # TRACEVLLM_CPU_NUM_OF_RESERVED_CPU (vLLM's default is 1)
        ("0", None, 8, 1, None),
        (None, "4", 2, 1, 4),  # TRACEVLLM_NUM_THREADS wins
        ("1", "3", 8, 1, 3),
        (None, None, 8, 3, 2),  # three ranks share the CPUs
        ("2", None, 8, 3, 2),
        (None, None, 2, 3, 1),  # more ranks than CPUs: one thread each
        (None, "4", 2, 3, 4),
    ],
)
def test_engine_num_threads(
    monkeypatch: pytest.MonkeyPatch,
    reserved: str | None,
    threads: str | None,
    torch_threads: int,
    world: int,
    expected: int | None,
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: torch_threads)
    for name, value in (
        ("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU", reserved),
        ("TRACEVLLM_NUM_THREADS", threads),
    ):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert cpu.engine_num_threads(world) == expected


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU", "2", "leaves no thread for the engine"),
        ("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU", "-1", "must be a whole number >= 0, got '-1'"),
        ("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU", "abc", "must be a whole number >= 0, got 'abc'"),
        ("TRACEVLLM_NUM_THREADS", "-2", "TRACEVLLM_NUM_THREADS must be a whole number"),
        ("TRACEVLLM_NUM_THREADS", "1.5", "TRACEVLLM_NUM_THREADS must be a whole number"),
    ],
)
def test_bad_thread_settings_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("TRACEVLLM_NUM_THREADS", raising=False)
    monkeypatch.delenv("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        cpu.engine_num_threads()


@pytest.mark.parametrize(
    ("env", "world", "expected"),
    [
        ({}, 1, True),  # nothing set: the count adapts
        ({"TRACEVLLM_NUM_THREADS": "2"}, 1, False),  # the user's count
        ({"TRACEVLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, 1, False),  # set, even to 0
        ({"TRACEVLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, 1, False),
        ({"TRACEVLLM_CPU_ADAPTIVE_THREADS": "0"}, 1, False),  # turned off
        ({"TRACEVLLM_CPU_ADAPTIVE_THREADS": "1"}, 1, True),
        ({}, 2, False),  # several ranks keep their equal shares
    ],
)
def test_adaptive_threads_only_when_nothing_fixes_the_count(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], world: int, expected: bool
) -> None:
    """Mutation caught: the TRACEVLLM_CPU_NUM_OF_RESERVED_CPU clause dropped
    from adaptive_threads (a reserved CPU would adapt anyway)."""
    for name in (
        "TRACEVLLM_NUM_THREADS",
        "TRACEVLLM_CPU_NUM_OF_RESERVED_CPU",
        "TRACEVLLM_CPU_ADAPTIVE_THREADS",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cpu.adaptive_threads(world) is expected


_MMAPPED = textwrap.dedent(
    """
    import ctypes, sys
    from tracevllm.platforms import cpu

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    tuned = cpu.tune_malloc() if sys.argv[1] == "tune" else None
    before = libc.mallinfo2()
    block = libc.malloc(16 << 20)
    mmapped = libc.mallinfo2().hblkhd - before.hblkhd
    libc.free(block)
    kept = libc.mallinfo2().fordblks  # free bytes the heap still holds
    print(tuned, mmapped, kept >= 16 << 20)
    """
)


def _glibc_malloc_in_use() -> bool:
    """glibc 2.33+ (mallinfo2), and no other allocator preloaded."""
    if not sys.platform.startswith("linux"):
        return False
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return False
    return hasattr(ctypes.CDLL(None), "mallinfo2")


@pytest.mark.skipif(not _glibc_malloc_in_use(), reason="glibc's malloc (2.33+) not in use")
def test_tune_malloc_keeps_step_sized_blocks_off_mmap() -> None:
    """A 16 MiB block is its own mmap by default; once tuned it comes from the
    heap, and the heap keeps it after it is freed, for the next step.

    Each case in a fresh interpreter: glibc raises its mmap threshold by
    itself after such a block is freed, which a long process may have done.
    """

    def mmapped(mode: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", _MMAPPED, mode],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return out.stdout.split()

    untuned, tuned = mmapped("default"), mmapped("tune")
    assert untuned[0] == "None" and int(untuned[1]) >= 16 << 20 and untuned[2] == "False"
    assert tuned == ["True", "0", "True"]
