"""``make bench-parallel``: what tensor, pipeline and data parallelism cost on this machine,
and what the same arithmetic says for a real cluster.

Three parts, one run:

1. The engine at each layout, on one small workload (8 prompts of 24 random
   token ids, 24 greedy tokens each, ``ignore_eos``; each layout in a child
   process under a timeout, its engine core in that process, its workers in
   their own; one thread per rank): T = 1 and 2 on a tiny random-weight Llama
   (4 layers, hidden 64, 4 query / 2 KV heads), T = 1 and 3 on the default
   model (9 query / 3 KV heads), P = 2 on the tiny model with and without
   EngineCore's batch queue (each stage's busy share, and how long both ran
   at once), D = 2, and async scheduling off and on on the
   ``mp`` backend at T = 1 and 2 (the engine core schedules step N+1 while
   the workers run step N). Each runs traced at
   ``--detail full``, which makes a span of every collective with its
   milliseconds: the communication share is rank 0's collective time over
   its ``ModelRunner.execute_model`` + ``sample_tokens`` time. Full detail
   slows every step (a span per layer and per collective), so the step times
   are upper bounds; their ratios are what to read.
2. The collectives on their own: ``torch.distributed`` (gloo, 127.0.0.1) on
   two processes, an all-reduce (``GroupCoordinator.all_reduce``, what
   ``RowParallelLinear`` calls), a plain send/recv of one tensor, and a
   send/recv of a tensor dict
   (``send_tensor_dict`` / ``recv_tensor_dict``, what a pipeline stage hands
   the next) at a few sizes.
3. The arithmetic for a cluster (computed, nothing measured): Llama-3-8B and
   70B in bf16, the bytes a tensor-parallel layer all-reduces (two all-reduces
   of tokens x hidden x 2 bytes per layer), against NVLink (H100 SXM, ~900
   GB/s) and PCIe Gen5 (~64 GB/s); a pipeline stage boundary's bytes; what a
   data-parallel replica costs.

This machine has 2 cores, shared with other work while it runs: T = 3 is
three processes on two cores, so its step time measures contention as much
as communication. The numbers are noisy; the output says so.

Run: ``make bench-parallel`` or ``python benchmarks/bench_parallel.py
[--smoke] [--only TEXT]`` (``--smoke``: T = 1 and 2 and P = 2 with and
without the batch queue on the tiny model, 2 prompts x 4 tokens, one
all-reduce size; what tests/test_bench_parallel.py runs; ``--only async``:
the async scheduling rows alone, ``--only P=2`` the pipeline's).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tracevllm.executor.multiproc_executor import MultiprocExecutor  # noqa: E402

COMM_SPAN = "GroupCoordinator."
RUNNER_SPANS = ("ModelRunner.execute_model", "ModelRunner.sample_tokens")
FORWARD_SUFFIX = "ForCausalLM.forward"  # the model's forward span: one per step that ran it


@dataclasses.dataclass
class Layout:
    label: str
    model: str  # "tiny" | "default"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    batch_queue: bool = True
    async_scheduling: bool | None = None
    backend: str | None = None  # distributed_executor_backend (None: the engine's choice)
    unavailable: str | None = None  # why the engine cannot run it (yet)


@dataclasses.dataclass
class Result:
    layout: Layout
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    runner_ms: float = 0.0  # rank 0's execute_model + sample_tokens
    comm_ms: float = 0.0  # rank 0's collectives
    comm_calls: int = 0
    in_flight: int = 0  # EngineCore.max_batches_in_flight
    # P > 1: each stage's share of the timed wall time in ModelRunner.execute_model
    # (its TP rank 0, DP rank 0: the forward, not the wait for the previous stage),
    # and the milliseconds in which two stages ran at once.
    stage_busy: list[float] = dataclasses.field(default_factory=list)
    overlap_ms: float = 0.0
    error: str | None = None


# ------------------------------------------------------------ what exists
def engine_has_async_scheduling() -> bool:
    from tracevllm.engine.arg_utils import EngineArgs

    return "async_scheduling" in {f.name for f in dataclasses.fields(EngineArgs)}


def engine_has_data_parallel() -> bool:
    """vLLM's DPCoordinator (engine/coordinator.py) is what D > 1 runs on."""
    return importlib.util.find_spec("tracevllm.engine.coordinator") is not None


def pp_layouts() -> list[Layout]:
    """P = 2 without the batch queue (EngineCore.step: one step in flight,
    the stages taking turns) and with it (step_with_batch_queue, two)."""
    return [
        Layout("P=2, no batch queue", "tiny", pp=2, batch_queue=False),
        Layout("P=2, batch queue", "tiny", pp=2),
    ]


def layouts(smoke: bool) -> list[Layout]:
    if smoke:
        return [Layout("T=1", "tiny"), Layout("T=2", "tiny", tp=2), *pp_layouts()]
    rows = [
        Layout("T=1", "tiny"),
        Layout("T=2", "tiny", tp=2),
        Layout("T=1", "default"),
        Layout("T=3", "default", tp=3),
        *pp_layouts(),
    ]
    dp = Layout("D=2", "tiny", dp=2)
    if not engine_has_data_parallel():
        dp.unavailable = "not available: data parallelism (DPCoordinator) is not in the engine yet"
    rows.append(dp)
    # Async scheduling on the mp backend (T = 1 too: "uni" runs the step in
    # the engine core's own process, so on CPU nothing overlaps there).
    for tp in (1, 2):
        for on in (False, True):
            row = Layout(f"T={tp} (mp), async scheduling {'on' if on else 'off'}", "tiny",
                         tp=tp, async_scheduling=on, backend="mp")  # fmt: skip
            if not engine_has_async_scheduling():
                row.unavailable = "not available: async scheduling is not in the engine yet"
            rows.append(row)
    return rows


# ------------------------------------------------------------ the engine runs
def make_tiny_model(path: str, default_dir: str) -> str:
    from transformers.utils import logging as hf_logging

    from tests.utils import make_tiny_llama

    hf_logging.disable_progress_bar()  # save_pretrained's bar, in the middle of the report

    return make_tiny_llama(path, seed=0, tokenizer_from=default_dir, num_hidden_layers=4)


class NoBatchQueueExecutor(MultiprocExecutor):
    """The ``mp`` executor with one batch in flight: EngineCore steps
    synchronously, the pipeline stages taking turns. As in vLLM 0.22.0 there
    is no flag for it: EngineCore uses the batch queue exactly when its
    executor's ``max_concurrent_batches`` is above 1 (P for ``mp`` with P
    stages), and ``distributed_executor_backend`` takes an ``Executor``
    subclass. (At module level: the config that names it is pickled to the
    workers.)"""

    @property
    def max_concurrent_batches(self) -> int:
        return 1


def run_layout(layout: Layout, model_dir: str, num_prompts: int, max_tokens: int) -> Result:
    """One engine at ``layout``: a warm-up request, then the timed workload,
    traced at detail full; the figures read back from its spans."""
    import random

    from tracevllm import LLM, SamplingParams
    from tracevllm.tracing.exporters import read_spans_jsonl

    result = Result(layout)
    kwargs: dict[str, Any] = {}
    if layout.tp * layout.pp > 1:
        kwargs["distributed_executor_backend"] = (
            "mp" if layout.batch_queue else NoBatchQueueExecutor
        )
    if layout.pp > 1:
        # A step's requests are not scheduled again while it is in flight, so
        # P steps in flight need P batches of different requests: a token
        # budget of num_prompts / P per step (decodes in P groups, prompts in
        # chunks), the same with and without the batch queue.
        kwargs["max_num_batched_tokens"] = max(1, num_prompts // layout.pp)
    if layout.async_scheduling is not None:
        kwargs["async_scheduling"] = layout.async_scheduling
    if layout.backend is not None:
        kwargs["distributed_executor_backend"] = layout.backend
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(24)]}
               for _ in range(num_prompts)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as trace_dir:
        llm = LLM(
            model=model_dir,
            tensor_parallel_size=layout.tp,
            pipeline_parallel_size=layout.pp,
            data_parallel_size=layout.dp,
            max_num_seqs=num_prompts,
            max_model_len=256,
            # D > 1 runs an engine core per rank in its own process.
            enable_multiprocessing=layout.dp > 1,
            trace_detail="full",
            trace_dir=trace_dir,
            **kwargs,
        )
        try:
            for _ in range(2):  # warm-up: the first steps of a process are slow
                llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
            start_ns = time.time_ns()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            result.seconds = time.perf_counter() - start
            result.tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            core = getattr(llm.llm_engine.engine_core, "engine_core", None)
            result.in_flight = getattr(core, "max_batches_in_flight", 0)
        finally:
            llm.shutdown()
        spans = [s for s in read_spans_jsonl(os.path.join(trace_dir, "spans.jsonl"))
                 if s.start_ns >= start_ns]  # fmt: skip
    forwards: dict[int, int] = {}  # by DP rank
    stage_runs: dict[int, list[tuple[int, int]]] = {}  # by PP rank: execute_model spans
    for s in spans:
        where = (s.resource.get(f"tracevllm.{axis}_rank", 0) for axis in ("tp", "pp", "dp"))
        tp_rank, pp_rank, dp_rank = where
        if s.name == RUNNER_SPANS[0] and tp_rank == 0 and dp_rank == 0:
            stage_runs.setdefault(pp_rank, []).append((s.start_ns, s.end_ns))
        # The first stage's TP rank 0 of each engine runs every step's
        # forward; the runner and collective times are DP rank 0's.
        if tp_rank != 0 or pp_rank != 0:
            continue
        if s.name.endswith(FORWARD_SUFFIX):
            forwards[dp_rank] = forwards.get(dp_rank, 0) + 1
        elif dp_rank != 0:
            continue
        elif s.name in RUNNER_SPANS:
            result.runner_ms += (s.end_ns - s.start_ns) / 1e6
        elif s.name.startswith(COMM_SPAN):
            result.comm_ms += float(s.attributes.get("tracevllm.comm.ms", 0.0))
            result.comm_calls += 1
    # Steps that ran the model (not the last, which only frees requests):
    # with D engines, the busiest one's.
    result.steps = max(forwards.values(), default=0)
    if layout.pp > 1:
        wall_ns = result.seconds * 1e9
        runs = [sorted(stage_runs.get(r, [])) for r in range(layout.pp)]
        result.stage_busy = [sum(e - s for s, e in rs) / wall_ns for rs in runs]
        result.overlap_ms = overlap_ns(runs[0], runs[1]) / 1e6
    return result


def overlap_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """How long two sorted lists of disjoint (start, end) intervals overlap."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


RESULT = "RESULT="
# Start-up alone (three processes importing torch, the workers loading) takes
# 60-90 s at a load average over 10 on the two cores.
LAYOUT_TIMEOUT_S = {"tiny": 240, "default": 360}


def run_layout_in_child(
    layout: Layout, model_dir: str, num_prompts: int, max_tokens: int
) -> Result:
    """``run_layout`` in a fresh interpreter, its own process group, under a
    timeout: a layout that crashes or hangs (its workers with it) is killed
    and reported, and the others still run."""
    job = {"layout": dataclasses.asdict(layout), "model_dir": model_dir,
           "num_prompts": num_prompts, "max_tokens": max_tokens}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    timeout = LAYOUT_TIMEOUT_S[layout.model]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this call made: the run and its workers
        proc.communicate()
        return Result(layout, error=f"no answer in {timeout} s: killed")
    line = next((x for x in out.splitlines() if x.startswith(RESULT)), None)
    if proc.returncode != 0 or line is None:
        why = f"exit code {proc.returncode}" + ("" if line is None else " after its result")
        return Result(layout, error=f"{why}: {_last_error(err)}"[:200])
    fields = json.loads(line.removeprefix(RESULT))
    fields["layout"] = layout
    return Result(**fields)


def _last_error(stderr: str) -> str:
    """The line that says what went wrong: the last exception line of the
    child's stderr, not a warning printed at exit after it (the resource
    tracker's, for one)."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    for x in reversed(lines):
        if re.match(r"[\w.]*(Error|Exception|Interrupt|Exit)\b", x):
            return x
    return lines[-1] if lines else "(nothing on stderr)"


# ------------------------------------------------------------ the collectives alone
def _collective_rank(rank: int, init_method: str, sizes: list[int], iters: list[int],
                     results: Any) -> None:  # fmt: skip
    import torch

    from tracevllm.distributed import parallel_state as ps

    torch.set_num_threads(1)
    ps.init_distributed_environment(2, rank, init_method, rank, "gloo")
    ps.initialize_model_parallel(2, 1)
    tp, world = ps.get_tp_group(), ps.get_world_group()
    out = []
    for nbytes, n in zip(sizes, iters):
        x = torch.ones(nbytes // 4)  # fp32
        reduce_s, send_s, sendrecv_s = [], [], []
        for _ in range(n + 2):  # the first two: warm-up
            world.barrier()
            t = time.perf_counter()
            tp.all_reduce(x.clone())
            reduce_s.append(time.perf_counter() - t)
        for _ in range(n + 2):
            world.barrier()
            t = time.perf_counter()
            if rank == 0:
                torch.distributed.send(x, dst=1, group=world.device_group)
            else:
                torch.distributed.recv(x, src=0, group=world.device_group)
            send_s.append(time.perf_counter() - t)
        for _ in range(n + 2):
            world.barrier()
            t = time.perf_counter()
            # A pipeline stage's hand-over: half the bytes each, as
            # hidden_states and residual.
            if rank == 0:
                world.send_tensor_dict({"hidden_states": x[: x.numel() // 2],
                                        "residual": x[x.numel() // 2 :]})  # fmt: skip
            else:
                world.recv_tensor_dict()
            sendrecv_s.append(time.perf_counter() - t)
        medians = (statistics.median(t[2:]) for t in (reduce_s, send_s, sendrecv_s))
        out.append((nbytes, *medians))
    if rank == 1:  # the receiver's clock: it waits for the whole transfer
        results.put(out)
    world.barrier()
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


Timings = list[tuple[int, float, float, float]]


def measure_collectives(sizes: list[int], iters: list[int]) -> Timings:
    """(bytes, all-reduce s, send/recv s, send/recv-dict s), medians, on two gloo ranks."""
    import torch.multiprocessing as mp

    from tracevllm.utils.network_utils import get_distributed_init_method, get_open_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    procs = [ctx.Process(target=_collective_rank, args=(r, init_method, sizes, iters, results),
                         daemon=True) for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        out: Timings = results.get(timeout=180)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out


# ------------------------------------------------------------ a real cluster
# (name, hidden size, decoder layers, parameters): Llama-3's config.json.
MODELS = [("Llama-3-8B", 4096, 32, 8.0e9), ("Llama-3-70B", 8192, 80, 70.6e9)]
DTYPE_BYTES = 2  # bf16
LINKS = [("NVLink (H100 SXM)", 900e9), ("PCIe Gen5 x16", 64e9)]
H100_BF16_FLOPS = 989e12  # dense, peak
H100_HBM_BYTES_S = 3.35e12
H100_MEMORY = 80e9


def allreduce_bytes_per_layer(tokens: int, hidden: int) -> int:
    """Two all-reduces per decoder layer (after o_proj and after down_proj),
    each of the layer's output: tokens x hidden x dtype bytes."""
    return 2 * tokens * hidden * DTYPE_BYTES


def ring_seconds(nbytes: float, tp: int, bandwidth: float) -> float:
    """A ring all-reduce moves 2 (T - 1) / T of the buffer over each GPU's link."""
    return 2 * (tp - 1) / tp * nbytes / bandwidth


def forward_seconds(params: float, tokens: int, tp: int) -> float:
    """A GPU's share of one forward, at peak: the larger of its FLOPs
    (2 x params x tokens / T) and its weight reads (2 bytes x params / T)."""
    compute = 2 * params * tokens / tp / H100_BF16_FLOPS
    memory = DTYPE_BYTES * params / tp / H100_HBM_BYTES_S
    return max(compute, memory)


def cluster_table() -> Table:
    table = Table(title="Tensor parallelism on a cluster (computed: peak H100 figures, bf16)")
    for col in ("model", "phase", "tokens", "T", "all-reduce / layer", "forward (GPU)",
                *(f"comm: {name}" for name, _ in LINKS)):  # fmt: skip
        table.add_column(col, justify="left" if col in ("model", "phase") else "right")
    for name, hidden, layers, params in MODELS:
        for phase, tokens in (("decode", 64), ("prefill", 8192)):
            for tp in (2, 8):
                per_layer = allreduce_bytes_per_layer(tokens, hidden)
                fwd = forward_seconds(params, tokens, tp)
                cells = []
                for _, bw in LINKS:
                    comm = layers * ring_seconds(per_layer, tp, bw)
                    cells.append(f"{comm * 1e3:.2f} ms ({comm / fwd:.0%})")
                table.add_row(name, phase, str(tokens), str(tp), _size(per_layer),
                              f"{fwd * 1e3:.2f} ms", *cells)  # fmt: skip
    return table


def cluster_notes() -> list[str]:
    """Where TP wins, where PP wins, what DP costs, from the same figures."""
    _, hidden8, layers8, params8 = MODELS[0]
    _, hidden70, layers70, params70 = MODELS[1]
    boundary = 8192 * hidden70 * DTYPE_BYTES * 2  # hidden_states + residual
    nv, pcie = LINKS[0][1], LINKS[1][1]
    weights70 = params70 * DTYPE_BYTES
    return [
        "Bandwidth only (no latency, no overlap); NVLink's 900 GB/s counts both directions, "
        "NCCL's all-reduce reaches about half of it, so real TP costs are about twice these.",
        f"TP wins inside a node: at T=8 on NVLink a 70B decode step's {2 * layers70} "
        f"all-reduces cost {layers70 * ring_seconds(allreduce_bytes_per_layer(64, hidden70), 8, nv) * 1e3:.2f} ms "  # noqa: E501
        f"against {forward_seconds(params70, 64, 8) * 1e3:.1f} ms of weight reads, which T cuts "
        "by T: TP lowers every token's latency. Over PCIe the same all-reduces take "
        f"{nv / pcie:.0f}x longer, and at prefill they cost more than the compute.",
        f"PP wins across slow links: a stage boundary moves one layer output (hidden_states + "
        f"residual), {_size(boundary)} for a 70B prefill of 8192 tokens, once per stage, "
        f"{boundary / pcie * 1e3:.1f} ms over PCIe, where TP would all-reduce "
        f"{_size(layers70 * allreduce_bytes_per_layer(8192, hidden70))} over the same link. "
        "Its price is the bubble: without P micro-batches in flight (the batch queue) "
        "P stages run one at a time and each token waits for all of them.",
        f"DP costs memory, not traffic: each replica holds the whole model "
        f"({_size(params8 * DTYPE_BYTES)} for 8B, fits one 80 GB H100; "
        f"{_size(weights70)} for 70B, needs T >= {int(-(-weights70 // H100_MEMORY))} per "
        "replica), and the engines only agree on the request wave between steps. "
        "It multiplies throughput, never lowers a token's latency.",
    ]


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


# ------------------------------------------------------------ the report
def engine_table(results: list[Result]) -> Table:
    table = Table(title="The engine at each layout (this machine, traced at detail full)")
    for col in ("model", "layout", "tok/s", "ms/step", "steps", "rank 0 runner ms",
                "collectives", "comm share", "in flight", "stages busy (at once)"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("model", "layout") else "right")
    for r in results:
        lay = r.layout
        if lay.unavailable or r.error:
            why = "not available" if lay.unavailable else f"failed: {r.error}"
            table.add_row(lay.model, lay.label, why, *[""] * 7)
            continue
        share = f"{r.comm_ms / r.runner_ms:.0%}" if r.runner_ms and lay.tp > 1 else "-"
        busy = "-"
        if lay.pp > 1:
            share = "n/a"  # a stage's send waits for the next stage: not transfer time
            busy = " + ".join(f"{b:.0%}" for b in r.stage_busy)
            busy += f" ({r.overlap_ms / 1e3 / r.seconds:.0%})"
        table.add_row(
            lay.model, lay.label, f"{r.tokens / r.seconds:.1f}",
            f"{r.seconds / max(r.steps, 1) * 1e3:.1f}", str(r.steps), f"{r.runner_ms:.0f}",
            f"{r.comm_calls} ({r.comm_ms:.0f} ms)" if r.comm_calls else "0", share,
            str(r.in_flight) if r.in_flight else "-", busy,
        )  # fmt: skip
    return table


def pipeline_notes(results: list[Result]) -> list[str]:
    """What the P rows show, against what P devices would."""
    rows = {r.layout.batch_queue: r for r in results
            if r.layout.pp > 1 and not r.error and not r.layout.unavailable}  # fmt: skip
    if len(rows) < 2:
        return []
    off, on = rows[False], rows[True]
    p = on.layout.pp
    return [
        f"P={p}, arithmetic: on {p} devices of their own, with one batch in flight a stage "
        f"idles at least {p - 1}/{p} of the time (it waits for the other stages), so {p} "
        f"stages run no faster than one device; with {p} batches in flight every stage can "
        f"be busy, up to {p}x the throughput once the pipeline is full.",
        f"P={p}, here: both stages at once {off.overlap_ms / 1e3 / off.seconds:.0%} of the "
        f"time without the batch queue, {on.overlap_ms / 1e3 / on.seconds:.0%} with it; "
        f"tok/s {off.tokens / off.seconds:.1f} -> {on.tokens / on.seconds:.1f}, steps "
        f"{off.steps} -> {on.steps}"
        + (
            " (a request in flight is not scheduled again, so some steps hold fewer tokens)"
            if on.steps > off.steps
            else ""
        )
        + f", rank 0's runner time {off.runner_ms:.0f} -> {on.runner_ms:.0f} ms. The stages, "
        f"the engine core and any other work share {os.cpu_count()} cores (load average now "
        f"{os.getloadavg()[0]:.1f}): two stages at once are two processes taking turns on "
        "the same cores, unless a core is free.",
    ]


def collectives_table(rows: Timings) -> Table:
    table = Table(title="Collectives alone: torch.distributed gloo, 2 processes, 127.0.0.1")
    for col in ("bytes", "all-reduce", "bus GB/s", "send/recv", "GB/s", "send/recv_tensor_dict"):
        table.add_column(col, justify="right")
    for nbytes, reduce_s, send_s, dict_s in rows:
        table.add_row(
            _size(nbytes), f"{reduce_s * 1e6:.0f} us",
            f"{ring_seconds(nbytes, 2, 1) / reduce_s / 1e9:.2f}",
            f"{send_s * 1e6:.0f} us", f"{nbytes / send_s / 1e9:.2f}", f"{dict_s * 1e6:.0f} us",
        )  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="T=1, T=2 and P=2 with and without the batch queue, tiny model, 2 prompts x 4 tokens",
    )
    parser.add_argument("--output-json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--only", metavar="TEXT", help="only the layouts whose label holds TEXT (e.g. async)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one layout (run_layout_in_child)
    args = parser.parse_args(argv)
    if args.child:
        job = json.loads(args.child)
        result = run_layout(Layout(**job["layout"]), job["model_dir"], job["num_prompts"],
                            job["max_tokens"])  # fmt: skip
        print(RESULT + json.dumps(dataclasses.asdict(result)), flush=True)
        return 0
    from tracevllm.model_executor.model_loader import resolve_model

    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(
        f"bench-parallel on {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.2f}): "
        "a shared machine, so every time below is noisy; read the ratios."
    )
    num_prompts, max_tokens = (2, 4) if args.smoke else (8, 24)
    # One thread per rank (the workers' share when ranks outnumber the cores
    # anyway): T ranks use T cores, and T = 1 is not two threads fighting
    # over a loaded machine.
    os.environ["TRACEVLLM_NUM_THREADS"] = "1"
    default_dir = resolve_model(None)
    rows = [r for r in layouts(args.smoke) if args.only is None or args.only in r.label]
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-parallel-tiny-") as tiny_root:
        tiny_dir = make_tiny_model(os.path.join(tiny_root, "tiny"), default_dir)
        for i, layout in enumerate(rows, 1):
            head = f"[{i}/{len(rows)}] {layout.model} model, {layout.label}"
            if layout.unavailable:
                console.print(f"{head}: {layout.unavailable}")
                results.append(Result(layout))
                continue
            console.print(f"{head} ...", end="")
            start = time.perf_counter()
            model_dir = tiny_dir if layout.model == "tiny" else default_dir
            results.append(run_layout_in_child(layout, model_dir, num_prompts, max_tokens))
            console.print(f" {time.perf_counter() - start:.0f} s")
    console.print(engine_table(results))
    console.print(
        "ms/step: the timed generate's wall time over the steps that ran the model (with the "
        "batch queue, steps overlap). comm share: rank 0's collective time over its runner "
        "time (P rows: n/a, a stage's send waits for the next stage to receive, so its "
        "span is mostly waiting; see the collectives alone). in flight: the most steps "
        "EngineCore had in flight at once (batch queue only). stages busy: each stage's "
        "ModelRunner.execute_model time over the wall time, and (at once) the share of the "
        "wall time both stages ran."
    )
    for note in pipeline_notes(results):
        console.print(f"- {note}")
    sizes = [8 << 10] if args.smoke else [8 << 10, 256 << 10, 4 << 20]
    iters = [20] if args.smoke else [50, 20, 5]
    console.print(f"collectives alone: {', '.join(_size(s) for s in sizes)} ...")
    collectives = measure_collectives(sizes, iters)
    console.print(collectives_table(collectives))
    console.print(cluster_table())
    for note in cluster_notes():
        console.print(f"- {note}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({
                "layouts": [dataclasses.asdict(r) for r in results],
                "collectives": [dict(zip(("bytes", "all_reduce_s", "send_recv_s",
                                          "send_recv_tensor_dict_s"), row))
                                for row in collectives],
            }, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
