"""``make bench-roofline``: this machine's roofline, and where the default model sits on it.

Measured here, in one run:

- **sgemm**: ``torch.mm`` on large fp32 squares (the machine's compute
  ceiling), and the model's own linear shapes at decode batch sizes, through
  the same oneDNN packed-weight path the engine uses and through plain
  ``F.linear`` (the same weight again and again: it stays in cache, so these
  say what the arithmetic can do, not what DRAM feeds);
- **memory bandwidth**: a large copy (read + write) and a large streaming
  read (``sum``), 256 MiB each, far beyond any cache;
- **the engine**: the default model (SmolLM2-135M, fp32) through tracevllm's
  own ``LLM`` in one process. Decode: B requests of 32 prompt tokens, run to
  9 tokens each; a step whose batch is exactly B decode tokens is a decode
  step at batch B. Prefill: one request of T tokens (prefix caching off).
  ``ModelRunner.execute_model`` (the forward and the logits) is timed, and so
  are ``sample_tokens`` and the whole ``LLMEngine.step``.

Computed, from the model's shapes: FLOPs per step (2 per weight per token,
plus attention's QK and PV over the context) and bytes per step (every
weight once, plus the K/V the step reads and writes; activations left out,
so the intensity is an upper bound). Arithmetic intensity = FLOPs / bytes.
The roofline is min(peak FLOP/s, intensity x bandwidth) with the measured
peak and the measured streaming read; the ridge is where the two meet.

Computed, not measured: the same arithmetic with NVIDIA's published H100 SXM
and H200 SXM peaks (dense, no sparsity) and HBM bandwidths, in fp32 (CUDA
cores) and in bf16 (tensor cores, half the weight bytes). A floor: a model
this small is bound on a GPU by kernel launches, which a roofline ignores.

Every figure is the best of several repeats (the machine may be shared: the
load average is saved beside them). Results: ``benchmarks/results/roofline.json``
(committed; the book draws its plot from it), and the plot as PNG and SVG in
``bench-results/``.

    python benchmarks/roofline.py                 # measure, print, save, draw
    python benchmarks/roofline.py --draw-only --out docs/assets/recorded/roofline.svg
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "roofline.json")
OUT_DIR = os.path.join(ROOT, "bench-results")

DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_TOKENS = [16, 32, 64, 128, 256, 512, 1024, 2048]
PROMPT_LEN = 32  # decode runs: prompt tokens per request
DECODE_TOKENS = 9  # decode runs: tokens per request (1 from the prefill, 8 decode steps)

# NVIDIA's published peaks (SXM, dense: the sparsity figures are 2x these).
# Computed from, never measured here.
GPUS = {
    "H100 SXM": {"fp32_tflops": 67.0, "bf16_tflops": 989.4, "hbm_tbps": 3.35},
    "H200 SXM": {"fp32_tflops": 67.0, "bf16_tflops": 989.4, "hbm_tbps": 4.8},
}


# ------------------------------------------------------------- the model's shapes
def model_shapes(model_dir: str | None = None) -> dict[str, Any]:
    """Linear shapes (out, in) as the engine holds them (fused qkv, fused gate/up),
    of ``model_dir`` (default: the default model)."""
    from transformers import AutoConfig

    from tracevllm.model_executor.model_loader import resolve_model

    cfg = AutoConfig.from_pretrained(resolve_model(model_dir))
    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    per_layer = {
        "qkv_proj": ((nq + 2 * nkv) * hd, h),
        "o_proj": (h, nq * hd),
        "gate_up_proj": (2 * inter, h),
        "down_proj": (h, inter),
    }
    layer_params = sum(o * i for o, i in per_layer.values())
    lm_head = cfg.vocab_size * h
    return {
        "name": os.path.basename(os.path.normpath(model_dir))
        if model_dir
        else "SmolLM2-135M-Instruct",
        "dtype_bytes": 4,
        "num_layers": layers,
        "per_layer": per_layer,
        "lm_head": (cfg.vocab_size, h),
        "linear_params": layers * layer_params,  # per token that is not sampled
        "lm_head_params": lm_head,  # only at logits rows
        "weight_bytes": 4 * (layers * layer_params + lm_head),
        # K and V, every layer: bytes one token of context occupies.
        "kv_bytes_per_token": 4 * layers * 2 * nkv * hd,
        # QK^T and PV, every layer: FLOPs per (query, key) pair.
        "attn_flops_per_pair": layers * 2 * 2 * nq * hd,
    }


# --8<-- [start:step_cost]
def step_cost(
    m: dict[str, Any], num_tokens: int, num_logits: int, pairs: int, ctx_tokens: int
) -> tuple[float, float]:
    """FLOPs and bytes of one step: ``num_tokens`` through the layers, ``num_logits``
    rows through the LM head, ``pairs`` (query, key) pairs of attention, and
    ``ctx_tokens`` tokens of K/V read (and ``num_tokens`` written)."""
    flops = 2 * (m["linear_params"] * num_tokens + m["lm_head_params"] * num_logits)
    flops += m["attn_flops_per_pair"] * pairs
    nbytes = m["weight_bytes"] + m["kv_bytes_per_token"] * (ctx_tokens + num_tokens)
    return float(flops), float(nbytes)


# --8<-- [end:step_cost]


def decode_cost(m: dict[str, Any], batch: int, ctx: float) -> tuple[float, float]:
    """A decode step: ``batch`` requests, each one token attending to ``ctx`` keys."""
    return step_cost(m, batch, batch, int(batch * ctx), int(batch * ctx))


def prefill_cost(m: dict[str, Any], tokens: int) -> tuple[float, float]:
    """One request's whole prompt in one step (causal: T(T+1)/2 pairs)."""
    return step_cost(m, tokens, 1, tokens * (tokens + 1) // 2, 0)


# ------------------------------------------------------------------ measuring
def best_of(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """Best wall time of one call of ``fn`` (each sample times ``inner`` calls)."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def measure_sgemm_squares(
    sizes: tuple[int, ...] = (1024, 2048, 3072), repeats: int = 5
) -> list[dict[str, Any]]:
    """``torch.mm`` on fp32 n x n squares, best of ``repeats``: seconds and GFLOP/s each."""
    import torch

    squares = []
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        t = best_of(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), repeats=repeats)
        squares.append({"n": n, "seconds": t, "gflops": 2 * n**3 / t / 1e9})
        print(f"  sgemm {n}x{n}: {squares[-1]['gflops']:.1f} GFLOP/s", flush=True)
    return squares


def measure_sgemm(m: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from tracevllm.model_executor.layers.linear import ReplicatedLinear

    squares = measure_sgemm_squares()

    # The model's linears at decode batch sizes: one layer's four and the LM head.
    shapes = dict(m["per_layer"]) | {"lm_head": m["lm_head"]}
    layers: dict[str, tuple[Any, Any]] = {}
    for name, (out_f, in_f) in shapes.items():
        layer = ReplicatedLinear(in_f, out_f, bias=False)
        torch.nn.init.normal_(layer.weight, std=0.02)
        plain = layer.weight.detach().clone()
        layer.process_weights_after_loading()  # packs it for oneDNN, as at load
        layers[name] = (layer, plain)
    decode = []
    with torch.inference_mode():
        for batch in (1, 8, 32, 64, 128, 256):
            row: dict[str, Any] = {"batch": batch}
            for path in ("packed", "plain"):
                flops = seconds = 0.0
                for name, (layer, plain) in layers.items():
                    out_f, in_f = shapes[name]
                    x = torch.randn(batch, in_f)
                    if path == "packed":
                        fn = lambda layer=layer, x=x: layer(x)  # noqa: E731
                    else:
                        fn = lambda x=x, w=plain: F.linear(x, w)  # noqa: E731
                    inner = max(1, int(2e7 // (2 * batch * out_f * in_f)))
                    t = best_of(fn, repeats=5, inner=inner)
                    # A whole model's worth: every layer's four, one LM head.
                    times = 1 if name == "lm_head" else m["num_layers"]
                    flops += times * 2 * batch * out_f * in_f
                    seconds += times * t
                row[f"{path}_gflops"] = flops / seconds / 1e9
            decode.append(row)
            print(
                f"  model linears at batch {batch}: packed {row['packed_gflops']:.1f}, "
                f"F.linear {row['plain_gflops']:.1f} GFLOP/s",
                flush=True,
            )
    return {"squares": squares, "decode_shapes": decode}


class PackedLinears(NamedTuple):
    layers: list[dict[str, Any]]  # every layer's four linears, by name
    lm_head: Any


def packed_linears(m: dict[str, Any]) -> PackedLinears:
    """The model's linear layers as the engine runs them, every layer its own
    (``ReplicatedLinear``\\ s with random weights, packed for oneDNN as at
    load): as many weight bytes as the model's, so a forward reads them from
    memory as the engine's does."""
    import torch

    from tracevllm.model_executor.layers.linear import ReplicatedLinear

    def packed(out_f: int, in_f: int) -> Any:
        layer = ReplicatedLinear(in_f, out_f, bias=False)
        torch.nn.init.normal_(layer.weight, std=0.02)
        layer.process_weights_after_loading()
        return layer

    layers = [
        {name: packed(*shape) for name, shape in m["per_layer"].items()}
        for _ in range(m["num_layers"])
    ]
    return PackedLinears(layers, packed(*m["lm_head"]))


def linears_seconds(linears: PackedLinears, rows: int, logits: int, repeats: int = 3) -> float:
    """One forward's linears, timed, best of ``repeats``: ``rows`` rows through
    every layer's four in turn, then ``logits`` rows through the LM head. Only
    the matmuls: random inputs of each linear's width stand in for what the
    rest of the layer would compute."""
    import torch

    widths = {linear.input_size for layer in linears.layers for linear in layer.values()}
    inputs = {width: torch.randn(rows, width) for width in widths}
    head_in = torch.randn(logits, linears.lm_head.input_size)

    def forward() -> None:
        for layer in linears.layers:
            for linear in layer.values():
                linear(inputs[linear.input_size])
        if logits:
            linears.lm_head(head_in)

    with torch.inference_mode():
        return best_of(forward, repeats=repeats)


def measure_bandwidth() -> dict[str, Any]:
    import torch

    n = 64 * 1024 * 1024  # 256 MiB of fp32
    src, dst = torch.randn(n), torch.empty(n)
    copy = best_of(lambda: dst.copy_(src), repeats=7)
    read = best_of(lambda: src.sum(), repeats=7)
    out = {
        "bytes": 4 * n,
        "copy_gbps": 2 * 4 * n / copy / 1e9,  # read + write, as STREAM counts a copy
        "read_gbps": 4 * n / read / 1e9,
    }
    print(f"  copy {out['copy_gbps']:.1f} GB/s, streaming read {out['read_gbps']:.1f} GB/s")
    return out


class StepTimer:
    """Wraps one in-process engine's executor and step to time each step."""

    def __init__(self, llm: Any) -> None:
        self.rows: list[dict[str, Any]] = []
        engine = llm.llm_engine
        executor = engine.engine_core.engine_core.model_executor
        execute, sample, step = executor.execute_model, executor.sample_tokens, engine.step
        current: dict[str, Any] = {}

        def timed_execute(scheduler_output: Any) -> Any:
            t0 = time.perf_counter()
            out = execute(scheduler_output)
            current["forward_s"] = time.perf_counter() - t0
            current["num_tokens"] = scheduler_output.total_num_scheduled_tokens
            current["num_reqs"] = len(scheduler_output.num_scheduled_tokens)
            return out

        def timed_sample(grammar_output: Any = None) -> Any:
            t0 = time.perf_counter()
            out = sample(grammar_output)
            current["sample_s"] = time.perf_counter() - t0
            return out

        def timed_step() -> Any:
            current.clear()
            t0 = time.perf_counter()
            out = step()
            if current:
                self.rows.append(dict(current, step_s=time.perf_counter() - t0))
            return out

        executor.execute_model = timed_execute
        executor.sample_tokens = timed_sample
        engine.step = timed_step


def _best(rows: list[dict[str, Any]], key: str) -> float:
    return min(r[key] for r in rows)


def measure_engine(batches: list[int], prefill_tokens: list[int], repeats: int) -> dict[str, Any]:
    import random

    import torch

    from tracevllm import LLM, SamplingParams

    rng = random.Random(0)
    vocab_hi = 49000

    def ids(n: int) -> dict[str, list[int]]:
        return {"prompt_token_ids": [rng.randrange(100, vocab_hi) for _ in range(n)]}

    decode, prefill = [], []
    with LLM(
        enable_multiprocessing=False,
        enable_prefix_caching=False,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(4096, max(prefill_tokens)),
    ) as llm:
        timer = StepTimer(llm)
        params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
        llm.generate([ids(PROMPT_LEN)], params, use_tqdm=False)  # warm-up
        for batch in batches:
            samples: list[dict[str, Any]] = []
            for _ in range(repeats if batch <= 64 else 1):
                timer.rows.clear()
                llm.generate([ids(PROMPT_LEN) for _ in range(batch)], params, use_tqdm=False)
                samples += [
                    r for r in timer.rows if r["num_reqs"] == batch and r["num_tokens"] == batch
                ]
            row = {
                "batch": batch,
                "context": PROMPT_LEN + DECODE_TOKENS / 2,  # mean keys per query
                "steps": len(samples),
                "forward_s": _best(samples, "forward_s"),
                "sample_s": _best(samples, "sample_s"),
                "step_s": _best(samples, "step_s"),
                "median_step_s": sorted(r["step_s"] for r in samples)[len(samples) // 2],
            }
            decode.append(row)
            print(
                f"  decode batch {batch:>3}: forward {row['forward_s'] * 1e3:7.1f} ms, "
                f"step {row['step_s'] * 1e3:7.1f} ms ({len(samples)} steps)",
                flush=True,
            )
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for tokens in prefill_tokens:
            timer.rows.clear()
            for _ in range(repeats if tokens <= 512 else 2):
                llm.generate([ids(tokens)], one, use_tqdm=False)
            samples = [r for r in timer.rows if r["num_tokens"] == tokens]
            row = {
                "tokens": tokens,
                "forward_s": _best(samples, "forward_s"),
                "step_s": _best(samples, "step_s"),
            }
            prefill.append(row)
            print(
                f"  prefill {tokens:>4} tokens: forward {row['forward_s'] * 1e3:7.1f} ms",
                flush=True,
            )
    return {"threads": torch.get_num_threads(), "decode": decode, "prefill": prefill}


# ------------------------------------------------------------------ analysis
def analyse(res: dict[str, Any]) -> dict[str, Any]:
    """Intensity and achieved GFLOP/s of every measured step; the ridge; GPU predictions."""
    m = res["model"]
    # The ceiling: the best any sgemm reached here (squares or the model's shapes).
    sg = res["sgemm"]
    peak = max(
        [s["gflops"] for s in sg["squares"]]
        + [r[k] for r in sg["decode_shapes"] for k in ("packed_gflops", "plain_gflops")]
    )
    peak *= 1e9
    bw = res["bandwidth"]["read_gbps"] * 1e9
    out: dict[str, Any] = {"peak_gflops": peak / 1e9, "bw_gbps": bw / 1e9, "ridge": peak / bw}
    for row in res["engine"]["decode"]:
        flops, nbytes = decode_cost(m, row["batch"], row["context"])
        row |= {
            "flops": flops,
            "bytes": nbytes,
            "intensity": flops / nbytes,
            "gflops": flops / row["forward_s"] / 1e9,
            "gbps": nbytes / row["forward_s"] / 1e9,
            "bound_s": max(flops / peak, nbytes / bw),
            "tok_s": row["batch"] / row["step_s"],
        }
    for row in res["engine"]["prefill"]:
        flops, nbytes = prefill_cost(m, row["tokens"])
        row |= {
            "flops": flops,
            "bytes": nbytes,
            "intensity": flops / nbytes,
            "gflops": flops / row["forward_s"] / 1e9,
            "bound_s": max(flops / peak, nbytes / bw),
        }
    # The smallest decode batch whose intensity is past the ridge.
    ctx = res["engine"]["decode"][0]["context"]
    out["decode_ridge_batch"] = _ridge_batch(m, ctx, peak, bw, 1.0)
    gpus = {}
    for name, g in GPUS.items():
        for dtype, tflops, scale in (
            ("fp32", g["fp32_tflops"], 1.0),
            ("bf16", g["bf16_tflops"], 0.5),
        ):
            gp, gbw = tflops * 1e12, g["hbm_tbps"] * 1e12
            steps = []
            for batch in DECODE_BATCHES:
                flops, nbytes = decode_cost(m, batch, ctx)
                nbytes *= scale
                t = max(flops / gp, nbytes / gbw)
                steps.append({"batch": batch, "bound_s": t, "tok_s": batch / t})
            gpus[f"{name} {dtype}"] = {
                "peak_tflops": tflops,
                "hbm_tbps": g["hbm_tbps"],
                "ridge": gp / gbw,
                "decode_ridge_batch": _ridge_batch(m, ctx, gp, gbw, scale),
                "decode": steps,
            }
    out["gpus"] = gpus
    out["max_decode_intensity"] = {
        f"{dtype} ctx {c}": max_decode_intensity(m, c, scale)
        for dtype, scale in (("fp32", 1.0), ("bf16", 0.5))
        for c in (int(ctx), 1000)
    }
    return out


def _ridge_batch(m: dict[str, Any], ctx: float, peak: float, bw: float, scale: float) -> int | None:
    """The smallest decode batch whose intensity reaches the ridge (None: no batch does).

    Per request a decode step does f FLOPs and moves k bytes of K/V; the
    weights, W bytes, are shared: intensity(B) = B f / (W + B k), which grows
    towards f / k. It reaches the ridge R at B = R W / (f - R k), if f > R k.
    """
    ridge = peak / bw
    f, _ = decode_cost(m, 1, ctx)
    k = m["kv_bytes_per_token"] * (ctx + 1) * scale
    w = m["weight_bytes"] * scale
    if f <= ridge * k:
        return None
    return math.ceil(ridge * w / (f - ridge * k))


def max_decode_intensity(m: dict[str, Any], ctx: float, scale: float) -> float:
    """What intensity a decode step tends to as the batch grows (f / k above)."""
    f, _ = decode_cost(m, 1, ctx)
    return f / (m["kv_bytes_per_token"] * (ctx + 1) * scale)


# ------------------------------------------------------------------ printing
def print_tables(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    a = res["analysis"]
    console = Console()
    console.print(
        f"[bold]{res['machine']['cpu']}[/], {res['engine']['threads']} threads, load "
        f"{res['machine']['load_before']} -> {res['machine']['load_after']}: peak sgemm "
        f"{a['peak_gflops']:.1f} GFLOP/s, streaming read {a['bw_gbps']:.1f} GB/s, ridge "
        f"{a['ridge']:.1f} FLOP/byte (decode batch {a['decode_ridge_batch']})"
    )
    t = Table(title="Decode step vs batch (default model, fp32, best of the steps)")
    for col in ("batch", "FLOP/byte", "forward ms", "bound ms", "GFLOP/s", "GB/s", "step ms",
                "tok/s"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in res["engine"]["decode"]:
        t.add_row(
            str(r["batch"]),
            f"{r['intensity']:.1f}",
            f"{r['forward_s'] * 1e3:.1f}",
            f"{r['bound_s'] * 1e3:.1f}",
            f"{r['gflops']:.1f}",
            f"{r['gbps']:.1f}",
            f"{r['step_s'] * 1e3:.1f}",
            f"{r['tok_s']:.0f}",
        )
    console.print(t)
    t = Table(title="Prefill step vs prompt tokens (one request)")
    for col in ("tokens", "FLOP/byte", "forward ms", "bound ms", "GFLOP/s"):
        t.add_column(col, justify="right")
    for r in res["engine"]["prefill"]:
        t.add_row(
            str(r["tokens"]),
            f"{r['intensity']:.0f}",
            f"{r['forward_s'] * 1e3:.1f}",
            f"{r['bound_s'] * 1e3:.1f}",
            f"{r['gflops']:.1f}",
        )
    console.print(t)
    t = Table(title="Computed, not measured: the same decode steps on published GPU peaks")
    for col in ("GPU, dtype", "peak TFLOP/s", "HBM TB/s", "ridge FLOP/byte", "ridge batch",
                "batch 1 µs", "batch 256 µs"):  # fmt: skip
        t.add_column(col, justify="right" if col != "GPU, dtype" else "left")
    for name, g in a["gpus"].items():
        t.add_row(
            name,
            f"{g['peak_tflops']:.0f}",
            f"{g['hbm_tbps']:.2f}",
            f"{g['ridge']:.0f}",
            str(g["decode_ridge_batch"] or "never"),
            f"{g['decode'][0]['bound_s'] * 1e6:.0f}",
            f"{g['decode'][-1]['bound_s'] * 1e6:.0f}",
        )
    console.print(t)


# ------------------------------------------------------------------ drawing
def draw(res: dict[str, Any], paths: list[str]) -> None:
    """The roofline (left) and decode step time vs batch (right), from saved results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The same bytes from the same JSON: no date, fixed ids.
    plt.rcParams["svg.hashsalt"] = "tracevllm-roofline"
    a = res["analysis"]
    peak, bw = a["peak_gflops"], a["bw_gbps"]
    dec, pre = res["engine"]["decode"], res["engine"]["prefill"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")

    xs = [0.1 * 1.1**i for i in range(120)]
    ax.loglog(xs, [min(peak, x * bw) for x in xs], color="black", lw=1.5,
              label=f"roofline: {peak:.0f} GFLOP/s, {bw:.1f} GB/s")  # fmt: skip
    ax.axvline(a["ridge"], color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {a['ridge']:.1f} FLOP/B", (a["ridge"], peak * 0.02), rotation=90,
                ha="right", va="center", fontsize=8, color="gray")  # fmt: skip
    ax.loglog([r["intensity"] for r in dec], [r["gflops"] for r in dec], "o-", color="tab:blue",
              label="decode step, batch B (measured)")  # fmt: skip
    for r in dec:
        ax.annotate(str(r["batch"]), (r["intensity"], r["gflops"]), textcoords="offset points",
                    xytext=(-4, 6), fontsize=7, color="tab:blue")  # fmt: skip
    ax.loglog([r["intensity"] for r in pre], [r["gflops"] for r in pre], "s-", color="tab:orange",
              label="prefill, T tokens (measured)")  # fmt: skip
    for r in pre:
        ax.annotate(str(r["tokens"]), (r["intensity"], r["gflops"]), textcoords="offset points",
                    xytext=(4, -10), fontsize=7, color="tab:orange")  # fmt: skip
    ax.set_xlabel("arithmetic intensity (FLOP per byte of weights + KV)")
    ax.set_ylabel("GFLOP/s (model forward)")
    ax.set_title("This CPU: roofline and the default model's steps", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)

    batches = [r["batch"] for r in dec]
    bx.loglog(batches, [r["forward_s"] * 1e3 for r in dec], "o-", color="tab:blue",
              label="this CPU: forward (measured)")  # fmt: skip
    bx.loglog(batches, [r["step_s"] * 1e3 for r in dec], "o--", color="tab:blue", alpha=0.5,
              label="this CPU: whole engine step (measured)")  # fmt: skip
    bx.loglog(batches, [r["bound_s"] * 1e3 for r in dec], color="black", lw=1,
              label="this CPU: roofline bound (computed)")  # fmt: skip
    styles = {"H100 SXM bf16": ("tab:green", "-"), "H200 SXM bf16": ("tab:red", "-"),
              "H100 SXM fp32": ("tab:green", ":"), "H200 SXM fp32": ("tab:red", ":")}  # fmt: skip
    for name, g in a["gpus"].items():
        color, ls = styles.get(name, ("gray", "-"))
        bx.loglog([s["batch"] for s in g["decode"]], [s["bound_s"] * 1e3 for s in g["decode"]],
                  color=color, ls=ls, lw=1, label=f"{name}: bound (computed)")  # fmt: skip
    for _name, g, color in (("CPU", a, "black"),) + tuple(
        (n, g, styles.get(n, ("gray", ""))[0]) for n, g in a["gpus"].items() if "bf16" in n
    ):
        if g["decode_ridge_batch"] and g["decode_ridge_batch"] <= max(batches):
            bx.axvline(g["decode_ridge_batch"], color=color, ls=":", lw=0.8, alpha=0.7)
    bx.set_xscale("log", base=2)
    bx.set_xlabel("decode batch (requests, one token each)")
    bx.set_ylabel("ms per decode step")
    bx.set_title("Decode step vs batch: flat while memory-bound, then rising", fontsize=10)
    bx.legend(fontsize=7, loc="center left")
    bx.grid(True, which="both", alpha=0.2)
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, metadata={"Date": None} if path.endswith(".svg") else None, dpi=110)
        print("  wrote", os.path.relpath(path, ROOT))
    plt.close(fig)


# ------------------------------------------------------------------ main
def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load_before": _load()}


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--draw-only", action="store_true", help="draw from --json, measure nothing"
    )
    parser.add_argument("--json", default=RESULTS, help=f"results file (default {RESULTS})")
    parser.add_argument("--out", nargs="*", help="plot paths (.png/.svg)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer batches and prompt lengths")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: torch's own, one per core)"
    )
    args = parser.parse_args()
    outs = args.out or [
        os.path.join(OUT_DIR, "roofline.png"),
        os.path.join(OUT_DIR, "roofline.svg"),
    ]
    if args.draw_only:
        with open(args.json) as f:
            res = json.load(f)
        res["analysis"] = analyse(res)  # from the raw measurements, as this file computes
        draw(res, outs)
        return

    import torch

    if args.threads:
        # The engine's worker reads TRACEVLLM_NUM_THREADS; the sgemm runs here.
        os.environ["TRACEVLLM_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    res: dict[str, Any] = {"machine": machine(), "torch": torch.__version__}
    res["machine"]["threads"] = torch.get_num_threads()
    print(f"# {res['machine']['cpu']}, load {res['machine']['load_before']}", flush=True)
    res["model"] = model_shapes()
    print("# sgemm", flush=True)
    res["sgemm"] = measure_sgemm(res["model"])
    print("# memory bandwidth", flush=True)
    res["bandwidth"] = measure_bandwidth()
    print("# the engine (in process)", flush=True)
    batches = [1, 4, 16, 64] if args.quick else DECODE_BATCHES
    tokens = [32, 128, 512] if args.quick else PREFILL_TOKENS
    res["engine"] = measure_engine(batches, tokens, args.repeats)
    res["machine"]["load_after"] = _load()
    res["analysis"] = analyse(res)
    res["command"] = "make bench-roofline" + (
        f' ARGS="--threads {args.threads}"' if args.threads else ""
    )
    print_tables(res)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print("  wrote", os.path.relpath(args.json, ROOT))
    draw(res, outs)


if __name__ == "__main__":
    main()
