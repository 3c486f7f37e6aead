"""Keeping the garbage collector off the engine's startup heap.

Mirrors vllm/utils/gc_utils.py (``freeze_gc_heap``); vLLM's GC debug
callback (``VLLM_GC_DEBUG``) is left out.

Python's collector walks every tracked object of the generations it
collects. After startup the heap holds hundreds of thousands of them (torch's
Python side, transformers, the model's modules), and a full collection walks
them all: on the 2-core machine of the performance chapter, one took 0.1 to
0.25 s, in the middle of a step. Frozen objects are left out of every
collection.
"""

from __future__ import annotations

import atexit
import gc


def freeze_gc_heap() -> None:
    """Collect what startup left behind, then freeze everything still alive.

    Called at the end of ``EngineCore.__init__``; ``EngineCore.shutdown``
    unfreezes, so that an engine built and dropped in one process (tests,
    ``enable_multiprocessing=False``) can still be collected.
    """
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()
    # An in-process engine never shut down (a script that just ends): its heap
    # must be collectable at exit, or native extensions (Triton's nanobind
    # types, imported with transformers' config classes) report it as leaked.
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
