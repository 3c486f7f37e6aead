"""Where a decode step's and a prefill step's time goes, on the default model.

The engine runs in this process (so one clock sees every part) with tracing
off. Timers wrap the engine's own functions, one level at a time, and each
part is the time inside its function less the parts nested in it:

- **matmuls**: ``ReplicatedLinear.forward`` (q/k/v, o, gate/up, down: oneDNN
  on packed weights) and ``compute_logits`` (the LM head);
- **attention**: ``Attention.forward`` (write this step's K/V into the paged
  cache, then attend);
- **rest of the forward**: ``LlamaForCausalLM.forward`` less the two above
  (embedding, RMSNorm, RoPE, SiLU, residual adds, the Python between them);
- **_prepare_inputs**: ``ModelRunner._update_states`` + ``_prepare_inputs``;
- **sampler**: ``Sampler.forward``; **sample_tokens, rest**: the bookkeeping
  around it (token ids into the persistent batch, ``.tolist()``);
- **scheduler**: ``Scheduler.schedule`` + ``update_from_output``;
- **detokenization**: ``OutputProcessor.process_outputs`` (incremental
  detokenization, stop checks, ``RequestOutput``\\ s);
- **other Python**: ``LLMEngine.step`` less all of the above (the engine
  core's step, the clients, the glue).

Two costs the in-process step does not pay are measured beside it:

- **IPC**: with the engine core in its own process (the default), each step's
  ``EngineCoreOutputs`` is msgpack-encoded, sent over a ZeroMQ ipc socket and
  decoded: the same objects, captured from this run, encoded, sent and decoded
  here (best of many);
- **spans**: the same step with tracing at ``request`` and at ``full``
  detail, less the step without (best step of each).

A table of the top operators of one decode step (``torch.profiler``, self CPU
time) follows. Every figure is the best of the steps of its kind; the load
average is printed beside them (the machine may be shared). Results go to
``benchmarks/results/profile_step.json``, which the book's table is drawn from.

    python benchmarks/profile_step.py [--batch 64] [--prefill-tokens 512] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "profile_step.json")

# (part, how it is computed from the timed functions: + inclusive, - nested)
PARTS: list[tuple[str, list[str], list[str]]] = [
    ("matmuls (oneDNN linear + LM head)", ["linear", "compute_logits"], []),
    ("attention (KV write + paged attention)", ["attention"], []),
    ("rest of the forward (norms, RoPE, SiLU, ...)", ["model"], ["linear", "attention"]),
    ("_prepare_inputs + _update_states", ["prepare", "update_states"], []),
    ("sampler", ["sampler"], []),
    ("sample_tokens, rest", ["sample_tokens"], ["sampler"]),
    (
        "execute_model, rest",
        ["execute_model"],
        ["model", "compute_logits", "prepare", "update_states"],
    ),
    ("scheduler (schedule + update_from_output)", ["schedule", "update_from_output"], []),
    ("detokenization (process_outputs)", ["process_outputs"], []),
    (
        "other Python (engine core step, clients, glue)",
        ["step"],
        ["execute_model", "sample_tokens", "schedule", "update_from_output", "process_outputs"],
    ),  # fmt: skip
]


class Timers:
    """Inclusive time per wrapped function, summed over the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        current = self.current

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[name] = current.get(name, 0.0) + time.perf_counter() - t0

        setattr(obj, attr, timed)


def instrument(llm: Any, timers: Timers, meta: dict[str, Any]) -> None:
    from tracevllm.model_executor.layers import linear
    from tracevllm.model_executor.layers.attention import Attention

    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    executor = core.model_executor
    runner = executor.model_runner
    # Class-level: every layer's instances (restored by unpatch()). The
    # linear classes that define their own forward; the merged and QKV
    # projections take ColumnParallelLinear's.
    linears = [linear.ReplicatedLinear, linear.ColumnParallelLinear, linear.RowParallelLinear]
    meta["restore"] = [(cls, "forward", cls.forward) for cls in linears]
    meta["restore"].append((Attention, "forward", Attention.forward))
    for cls in linears:
        timers.wrap(cls, "forward", "linear")
    timers.wrap(Attention, "forward", "attention")
    timers.wrap(runner.model, "forward", "model")
    timers.wrap(runner.model, "compute_logits", "compute_logits")
    timers.wrap(runner, "_prepare_inputs", "prepare")
    timers.wrap(runner, "_update_states", "update_states")
    timers.wrap(runner.sampler, "forward", "sampler")
    timers.wrap(executor, "sample_tokens", "sample_tokens")
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update_from_output", "update_from_output")
    timers.wrap(engine.output_processor, "process_outputs", "process_outputs")

    execute = executor.execute_model

    def execute_model(scheduler_output: Any) -> Any:
        meta["num_tokens"] = scheduler_output.total_num_scheduled_tokens
        meta["num_reqs"] = len(scheduler_output.num_scheduled_tokens)
        return execute(scheduler_output)

    executor.execute_model = execute_model
    timers.wrap(executor, "execute_model", "execute_model")

    get_output = engine.engine_core.get_output

    def captured_get_output() -> Any:
        out = get_output()
        meta["last_outputs"] = out
        return out

    engine.engine_core.get_output = captured_get_output
    step = engine.step

    def timed_step() -> Any:
        timers.current.clear()
        meta.pop("num_tokens", None)
        profiler = meta.pop("profile_next", None)
        t0 = time.perf_counter()
        if profiler is not None:
            with profiler:
                out = step()
        else:
            out = step()
        elapsed = time.perf_counter() - t0
        if "num_tokens" in meta:
            row = dict(timers.current, step=elapsed)
            row["num_tokens"], row["num_reqs"] = meta["num_tokens"], meta["num_reqs"]
            timers.steps.append(row)
            if row["num_tokens"] == row["num_reqs"]:
                meta["decode_outputs"] = meta.get("last_outputs")
        return out

    engine.step = timed_step


def unpatch(meta: dict[str, Any]) -> None:
    for cls, attr, fn in meta.get("restore", []):
        setattr(cls, attr, fn)


def breakdown(rows: list[dict[str, float]]) -> dict[str, Any]:
    """The step whose total is the median of its kind, split into the parts."""
    row = sorted(rows, key=lambda r: r["step"])[len(rows) // 2]
    parts = {}
    for name, plus, minus in PARTS:
        parts[name] = sum(row.get(k, 0.0) for k in plus) - sum(row.get(k, 0.0) for k in minus)
    return {
        "step_s": row["step"],
        "best_step_s": min(r["step"] for r in rows),
        "steps": len(rows),
        "parts_s": parts,
    }


def ids(rng: random.Random, n: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(n)]}


def run_engine(
    batch: int,
    prefill_tokens: int,
    decode_tokens: int,
    trace_detail: str = "off",
    attention_backend: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    from tracevllm import LLM, SamplingParams

    rng = random.Random(0)
    timers, meta = Timers(), {}
    with tempfile.TemporaryDirectory() as trace_dir:
        kwargs: dict[str, Any] = {"attention_backend": attention_backend}
        if trace_detail != "off":
            kwargs |= {"trace_detail": trace_detail, "trace_dir": trace_dir}
        with LLM(enable_multiprocessing=False, enable_prefix_caching=False, **kwargs) as llm:
            params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
            llm.generate([ids(rng, 32)], params, use_tqdm=False)  # warm-up
            instrument(llm, timers, meta)
            try:
                llm.generate([ids(rng, 32) for _ in range(batch)], params, use_tqdm=False)
                decode = [r for r in timers.steps if r["num_tokens"] == r["num_reqs"] == batch]
                timers.steps.clear()
                one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
                for _ in range(3):
                    llm.generate([ids(rng, prefill_tokens)], one, use_tqdm=False)
                prefill = [r for r in timers.steps if r["num_tokens"] == prefill_tokens]
                # One more decode step under torch.profiler, for the operator table.
                ops: list[dict[str, Any]] = []
                if trace_detail == "off":
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    _profile_second_step(llm, rng, batch, meta, prof)
                    ops = top_ops(prof)
            finally:
                unpatch(meta)
    result = {"decode": breakdown(decode), "prefill": breakdown(prefill), "ops": ops}
    return result, meta


def _profile_second_step(llm: Any, rng: random.Random, batch: int, meta: dict[str, Any],
                         prof: Any) -> None:  # fmt: skip
    """Add ``batch`` requests, run the prefill step, then one decode step profiled."""
    from tracevllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, prompt in enumerate(ids(rng, 32) for _ in range(batch)):
        engine.add_request(f"profiled-{i}", prompt, params)
    engine.step()  # the prefill (4096-token budget: one step for 32 x batch <= 4096)
    meta["profile_next"] = prof
    engine.step()
    while engine.has_unfinished_requests():
        engine.step()


def top_ops(prof: Any, n: int = 12) -> list[dict[str, Any]]:
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {
            "op": e.key,
            "calls": e.count,
            "self_ms": e.self_cpu_time_total / 1e3,
            "share": e.self_cpu_time_total / total,
        }
        for e in events[:n]
    ]


def measure_ipc(outputs: Any, repeats: int = 200) -> dict[str, Any]:
    """Encode, send over a ZeroMQ ipc socket, receive and decode one step's outputs."""
    import zmq

    from tracevllm.engine import EngineCoreOutputs
    from tracevllm.serial_utils import MsgpackDecoder, MsgpackEncoder

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as d:
        addr = f"ipc://{d}/bench"
        pull = ctx.socket(zmq.PULL)
        pull.bind(addr)
        push = ctx.socket(zmq.PUSH)
        push.connect(addr)
        best = float("inf")
        size = 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            frame = encoder.encode(outputs)
            push.send(frame, copy=False)
            decoder.decode(pull.recv(copy=False))
            best = min(best, time.perf_counter() - t0)
            size = len(frame)
        push.close(0)
        pull.close(0)
    ctx.term()
    return {"seconds": best, "bytes": size}


def print_table(title: str, part: dict[str, Any], extra: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ("part", "ms", "%"):
        t.add_column(col, justify="left" if col == "part" else "right")
    total = part["step_s"]
    for name, s in part["parts_s"].items():
        t.add_row(name, f"{s * 1e3:.2f}", f"{100 * s / total:.1f}")
    t.add_row("[bold]LLMEngine.step (in process)[/]", f"[bold]{total * 1e3:.2f}[/]", "100.0")
    for name, s in extra.items():
        t.add_row(f"[dim]+ {name}[/]", f"{s * 1e3:.2f}", f"{100 * s / total:+.1f}")
    Console().print(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="decode batch (requests)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=9, help="tokens per request")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument(
        "--attention-backend", default=None, help="cpu_attn, torch (default: the engine's)"
    )
    parser.add_argument("--json", default=RESULTS)
    args = parser.parse_args()
    if args.threads:
        os.environ["TRACEVLLM_NUM_THREADS"] = str(args.threads)
    import torch

    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# load {load_before}; decode batch {args.batch}, prefill {args.prefill_tokens} tokens")
    backend = args.attention_backend
    res, meta = run_engine(args.batch, args.prefill_tokens, args.decode_tokens, "off", backend)
    ipc = measure_ipc(meta["decode_outputs"])
    spans = {}
    for detail in ("request", "full"):
        traced, _ = run_engine(args.batch, args.prefill_tokens, args.decode_tokens, detail, backend)
        spans[detail] = {
            kind: traced[kind]["best_step_s"] - res[kind]["best_step_s"]
            for kind in ("decode", "prefill")
        }
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out = {
        "command": "python benchmarks/profile_step.py"
        + (f" --threads {args.threads}" if args.threads else "")
        + (f" --attention-backend {backend}" if backend else ""),
        # The engine's count (TRACEVLLM_NUM_THREADS), else torch's default.
        "threads": args.threads or torch.get_num_threads(),
        "load_before": load_before,
        "load_after": load_after,
        "batch": args.batch,
        "prefill_tokens": args.prefill_tokens,
        "decode": res["decode"],
        "prefill": res["prefill"],
        "ipc": ipc,
        "spans": spans,
        "ops": res["ops"],
    }
    for kind, title in (("decode", f"Decode step, batch {args.batch}"),
                        ("prefill", f"Prefill step, {args.prefill_tokens} tokens")):  # fmt: skip
        extra = {
            f"IPC, 2 processes ({ipc['bytes']} B encoded)": ipc["seconds"] if kind == "decode"
            else 0.0,
            "spans, trace_detail=request": spans["request"][kind],
            "spans, trace_detail=full": spans["full"][kind],
        }  # fmt: skip
        print_table(f"{title} ({out['threads']} threads, load {load_before})", out[kind], extra)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Top operators of one decode step, batch {args.batch} (torch.profiler)")
    for col in ("operator", "calls", "self ms", "%"):
        t.add_column(col, justify="left" if col == "operator" else "right")
    for op in res["ops"]:
        t.add_row(op["op"], str(op["calls"]), f"{op['self_ms']:.2f}", f"{100 * op['share']:.1f}")
    Console().print(t)
    print(f"load after: {load_after}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", os.path.relpath(args.json, ROOT))


if __name__ == "__main__":
    main()
