"""The engine's CPU process settings: threads left to the frontend, and glibc's malloc."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from tracevllm.executor.abstract import UniProcExecutor
from tracevllm.platforms import cpu


@pytest.mark.parametrize(
    ("reserved", "threads", "cpus", "expected"),
    [
        (None, None, 8, 8),  # every allowed CPU
        ("1", None, 8, 7),  # TRACEVLLM_CPU_NUM_OF_RESERVED_CPU (vLLM's default is 1)
        ("3", None, 2, 1),  # never fewer than one thread
        (None, "4", 2, 4),  # TRACEVLLM_NUM_THREADS wins
        ("1", "3", 8, 3),
    ],
)
def test_engine_num_threads(
    monkeypatch: pytest.MonkeyPatch,
    reserved: str | None,
    threads: str | None,
    cpus: int,
    expected: int,
) -> None:
    monkeypatch.setattr(cpu, "allowed_cpus", lambda: cpus)
    for name, value in (
        ("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU", reserved),
        ("TRACEVLLM_NUM_THREADS", threads),
    ):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert cpu.engine_num_threads() == expected


def test_init_device_sets_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "allowed_cpus", lambda: 3)
    monkeypatch.delenv("TRACEVLLM_NUM_THREADS", raising=False)
    monkeypatch.setenv("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    config = SimpleNamespace(
        device_config=SimpleNamespace(device="cpu"), model_config=SimpleNamespace(seed=0)
    )
    before = torch.get_num_threads()
    try:
        UniProcExecutor.init_device(SimpleNamespace(vllm_config=config))  # type: ignore[arg-type]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
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
