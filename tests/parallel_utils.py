"""Run a function on N real torch.distributed ranks (gloo, 127.0.0.1) and collect results.

Each rank is a process started with spawn (torch.multiprocessing), joins the
world through a ``tcp://127.0.0.1`` rendezvous, makes the TP/PP groups,
calls ``fn(rank, *args)`` and sends back what it returns. A rank that raises
sends its traceback; one that hangs or dies is killed and the call fails,
so a broken collective fails the test instead of blocking pytest.
"""

from __future__ import annotations

import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _rank_main(
    rank: int,
    world_size: int,
    init_method: str,
    tp: int,
    pp: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    import torch

    from tracevllm.distributed import parallel_state

    torch.set_num_threads(1)  # N ranks on a 2-core machine
    try:
        parallel_state.init_distributed_environment(world_size, rank, init_method, rank, "gloo")
        parallel_state.initialize_model_parallel(tp, pp)
        # Plain pickle bytes: a tensor put on the queue as is would be shared
        # through a file descriptor that dies with this process.
        result = pickle.dumps(fn(rank, *args))
        results.put((rank, "ok", result))
        # Nobody leaves before everyone is done: a rank that destroys its
        # groups while another still reduces over them would hang it.
        parallel_state.get_world_group().barrier()
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: int | None = None,
    pp: int = 1,
    timeout: float = 120.0,
) -> list[Any]:
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]``, each on its own rank.

    ``fn`` must be importable (a module-level function), as spawn requires.
    ``tp`` defaults to ``world_size // pp``.
    """
    from tracevllm.utils.network_utils import get_distributed_init_method, get_open_port

    tp = world_size // pp if tp is None else tp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, init_method, tp, pp, fn, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(out))} gave no result "
                    f"within {timeout} s"
                ) from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        results.close()
        results.join_thread()
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    assert not bad, f"ranks exited with (rank, code) {bad}"
    return [out[rank] for rank in range(world_size)]


def init_world_of_one() -> None:
    """This process's world of one (as ``UniProcExecutor`` makes it), for
    tests that build a model or a ModelRunner directly; made once, kept."""
    from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from tracevllm.distributed import parallel_state
    from tracevllm.distributed.utils import temporary_file_init_method

    if parallel_state.model_parallel_is_initialized():
        return
    config = VllmConfig(
        ModelConfig(model="unused", hf_config={"architectures": ["LlamaForCausalLM"]}),
        CacheConfig(),
        SchedulerConfig(),
    )
    with temporary_file_init_method() as init_method:
        parallel_state.init_worker_distributed_environment(config, 0, init_method, 0)
